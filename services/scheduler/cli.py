"""`squall scheduler --config RUN`: dataset -> GRPO groups -> tasks, retries and the ledger."""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--dataset", help="training data, .jsonl or .parquet (overrides scheduler.dataset)")
    parser.add_argument("--group-size", type=int, help="attempts per sample (overrides scheduler.group_size)")
    parser.add_argument("--epochs", type=int, help="passes over the data (overrides scheduler.epochs)")


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging
    from squall.shared.redisconn import connect

    from .scheduler import Scheduler

    config = config_from_args(
        args, scheduler={"dataset": args.dataset, "group_size": args.group_size, "epochs": args.epochs}
    )
    configure_logging("scheduler", config.run.name, level=config.run.log_level)
    r = connect(config.run.redis_url, autostart=config.run.autostart_redis)
    return Scheduler(config, r).run()

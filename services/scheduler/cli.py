"""`squall scheduler --config RUN`: dataset -> GRPO groups -> tasks, retries and the ledger."""

from __future__ import annotations

import argparse
import sys

from squall.shared.cliargs import add_common_arguments, add_field_flag

EXIT_REDIS_UNAVAILABLE = 3  # Redis did not answer (at start, or within run.redis_outage_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_field_flag(parser, "--dataset", "scheduler.dataset")
    add_field_flag(parser, "--group-size", "scheduler.group_size")
    add_field_flag(parser, "--epochs", "scheduler.epochs")


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.errors import RedisUnavailable
    from squall.shared.logs import configure_logging, get_logger
    from squall.shared.redisconn import connect

    from .scheduler import Scheduler

    config = config_from_args(args)
    configure_logging("scheduler", config.run.name, level=config.run.log_level)
    try:
        r = connect(config.run.redis_url, autostart=config.run.autostart_redis)
        return Scheduler(config, r).run()
    except RedisUnavailable as exc:  # down at start, or past run.redis_outage_s: the URL is in it
        get_logger(component="scheduler").error("scheduler_redis_unavailable", error=str(exc))
        print(f"squall scheduler: {exc}", file=sys.stderr)
        return EXIT_REDIS_UNAVAILABLE

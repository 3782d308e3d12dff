"""`squall track`: log a run's metrics, rewards, ledger counts and rollout samples to the
backends in [tracking] (W&B, TensorBoard, MLflow). Heavy modules load only in main()."""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        choices=("wandb", "tensorboard", "mlflow"),
        help="backend to log to (repeatable; default: tracking.backends)",
    )
    parser.add_argument("--dir", metavar="DIR", help="tracking folder (default {run.dir}/tracking)")
    add_common_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from squall.shared.logs import configure_logging

    config = config_from_args(args, tracking={"backends": args.backend, "dir": args.dir})
    configure_logging("track", config.run.name, level=config.run.log_level)
    from .track import run

    return run(config)

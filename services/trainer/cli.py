"""`squall trainer --config RUN [--backend torch|verl]`: trajectories -> GRPO steps -> weights."""

from __future__ import annotations

import argparse
import sys

from squall.shared.cliargs import add_common_arguments

EXIT_REDIS_UNAVAILABLE = 3  # Redis stayed down past run.redis_outage_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument(
        "--backend", choices=["torch", "verl"], help="training backend (overrides trainer.backend)"
    )
    parser.add_argument(
        "--max-steps", type=int, help="stop after this many optimizer steps (overrides trainer.max_steps)"
    )


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging

    config = config_from_args(args, trainer={"backend": args.backend, "max_steps": args.max_steps})
    configure_logging("trainer", config.run.name, level=config.run.log_level)
    import os

    import torch

    # CPU threads for torch (the default 1 suits shared machines and GPU runs)
    torch.set_num_threads(int(os.environ.get("SQUALL_TORCH_THREADS", "1")))
    from squall.shared.errors import RedisUnavailable

    from .main import run

    try:
        return run(config)
    except RedisUnavailable as exc:  # the message names the URL and what to do
        print(f"squall trainer: {exc}", file=sys.stderr)
        return EXIT_REDIS_UNAVAILABLE

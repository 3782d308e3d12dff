"""`squall trainer --config RUN [--backend torch|verl]`: trajectories -> GRPO steps -> weights.

`--nproc-per-node N` (and, across machines, `--nnodes M --node-rank K --rdzv-endpoint
HOST:PORT`) starts N ranks per node through torchrun (`python -m torch.distributed.run`),
each running this same command without the launch options; `--ray [--ray-address ADDR]
--workers N` starts the N ranks as Ray Train workers instead. The launchers are
trainer/launch_torchrun.py and trainer/launch_ray.py; how the ranks work together is
trainer/distributed.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from squall.shared.cliargs import add_common_arguments, add_field_flag

EXIT_REDIS_UNAVAILABLE = 3  # Redis stayed down past run.redis_outage_s
EXIT_BAD_WORLD = 2  # more ranks than GPUs, or a checkpoint written by another world size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_field_flag(parser, "--backend", "trainer.backend")
    add_field_flag(parser, "--max-steps", "trainer.max_steps")
    launch = parser.add_argument_group("several ranks (torchrun: FSDP-sharded data parallel)")
    launch.add_argument("--nproc-per-node", type=int, metavar="N", help="ranks on this machine (one per GPU)")
    launch.add_argument("--nnodes", type=int, default=1, metavar="M", help="machines in the run (default 1)")
    launch.add_argument(
        "--node-rank", type=int, metavar="K", help="this machine's index, 0..M-1 (0 owns the bus)"
    )
    launch.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="node 0's address and a free port, the same on every node",
    )
    ray = parser.add_argument_group("several ranks on a Ray cluster (Ray Train)")
    ray.add_argument("--ray", action="store_true", help="start the ranks as Ray Train workers")
    ray.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the cluster's head (HOST:PORT); default: a cluster of this machine",
    )
    ray.add_argument("--workers", type=int, default=1, metavar="N", help="Ray workers = ranks (default 1)")


def main(args: argparse.Namespace) -> int:
    from .checkpoint import WorldSizeMismatch
    from .distributed import WorldSizeError
    from .launch_torchrun import launch_torchrun

    try:
        if args.ray or args.ray_address:
            return ray_launch(args)
        if args.nproc_per_node is not None or args.nnodes > 1:
            if args.nproc_per_node is None:
                raise WorldSizeError("--nnodes needs --nproc-per-node (ranks on each machine)")
            return launch_torchrun(args)
        return run_rank(args)
    except (WorldSizeMismatch, WorldSizeError) as exc:
        print(f"squall trainer: {exc}", file=sys.stderr)
        return EXIT_BAD_WORLD


def ray_launch(args: argparse.Namespace) -> int:
    """The ranks as Ray Train workers (trainer/launch_ray.py); the exit code."""
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging

    from .checkpoint import CheckpointStore
    from .launch_ray import RayLaunchError, launch_ray

    if args.nproc_per_node is not None:
        print("squall trainer: --ray starts the ranks itself: drop --nproc-per-node", file=sys.stderr)
        return EXIT_BAD_WORLD
    config = config_from_args(args)
    configure_logging("trainer", config.run.name, level=config.run.log_level)
    CheckpointStore.check_world_size(Path(config.run.dir) / "checkpoints", args.workers)
    try:
        return launch_ray(config, config.trainer.backend, workers=args.workers, address=args.ray_address)
    except RayLaunchError as exc:
        print(f"squall trainer: {exc}", file=sys.stderr)
        return EXIT_BAD_WORLD


def run_rank(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging

    config = config_from_args(args)
    configure_logging("trainer", config.run.name, level=config.run.log_level)
    import torch

    # CPU threads for torch (the default 1 suits shared machines and GPU runs)
    torch.set_num_threads(int(os.environ.get("SQUALL_TORCH_THREADS", "1")))
    from squall.shared.errors import RedisUnavailable

    from .trainer import run

    try:
        code = run(config)
    except RedisUnavailable as exc:  # the message names the URL and what to do
        print(f"squall trainer: {exc}", file=sys.stderr)
        code = EXIT_REDIS_UNAVAILABLE
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun rank whose work is durable and whose group is left skips interpreter
        # finalization: gloo's C++ threads can still hold tensors there, and freeing them
        # while Python tears down aborts the process (pytorch/pytorch#179291).
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

"""`squall trainer --config RUN [--backend torch|verl]`: trajectories -> GRPO steps -> weights.

`--nproc-per-node N` (and, across machines, `--nnodes M --node-rank K --rdzv-endpoint
HOST:PORT`) starts N ranks per node through torchrun (`python -m torch.distributed.run`),
each running this same command without the launch options; see trainer/distributed.py.
`--ray [--ray-address ADDR] --workers N` starts the N ranks as Ray Train workers instead
(trainer/ray_launch.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from squall.shared.cliargs import add_common_arguments, add_field_flag, field_flags

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


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line that starts this node's ranks, each running `squall trainer
    --config` (the other options go by `rank_environment`). WorldSizeError names a missing
    launch option."""
    from .distributed import WorldSizeError

    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise WorldSizeError("--nproc-per-node and --nnodes must be at least 1")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    if args.nnodes == 1:
        command.append("--standalone")  # a private rendezvous on a free local port
    else:
        if args.node_rank is None or not args.rdzv_endpoint:
            raise WorldSizeError(
                f"--nnodes {args.nnodes} needs --node-rank (0..{args.nnodes - 1}, this machine's index) and "
                "--rdzv-endpoint HOST:PORT (node 0's address, the same on every node)"
            )
        # static rendezvous: node 0 holds global rank 0, the rank that owns the bus
        command += [
            f"--nnodes={args.nnodes}",
            f"--node-rank={args.node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
        ]
    command += ["-m", "squall.cli", "trainer"]
    return command + (["--config", args.config] if args.config else [])


def rank_environment(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment plus the command-line overrides, for the ranks: through the
    environment (torchrun would take `--run` after the script name for its own `--run-path`;
    a Redis URL with a password stays out of argv)."""
    given = {"SQUALL_RUN__NAME": args.run, "SQUALL_RUN__REDIS_URL": args.redis_url}
    for section, fields in field_flags(args).items():
        for name, value in fields.items():
            given[f"SQUALL_{section.upper()}__{name.upper()}"] = value
    return {**os.environ, **{env: str(value) for env, value in given.items() if value is not None}}


def rank_processes(pid: int) -> dict[int, int]:
    """Global rank -> pid of the trainer ranks below process `pid` (torchrun's children)."""
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                continue  # that thread or process is gone
        try:
            env = Path(f"/proc/{parent}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [v[5:] for v in env if v.startswith(b"RANK=")]
        if parent != pid and ranks:
            found[int(ranks[0])] = parent
    return found


def launch(args: argparse.Namespace) -> int:
    """Start this node's ranks through torchrun and wait for them (its exit code).

    A SIGTERM/SIGINT is passed to the ranks, not to torchrun: rank 0 then finishes its step
    and checkpoint and stops the others, and every rank exits 0 (torchrun, signalled, would
    kill them and fail). Before the ranks exist it goes to torchrun."""
    import signal
    import subprocess

    from squall.shared.cliargs import config_from_args

    from .checkpoint import CheckpointStore
    from .distributed import check_devices

    config = config_from_args(args)
    check_devices(config.trainer.device, args.nproc_per_node)
    CheckpointStore.check_world_size(Path(config.run.dir) / "checkpoints", args.nproc_per_node * args.nnodes)
    proc = subprocess.Popen(
        torchrun_command(args), env=rank_environment(args), start_new_session=True
    )  # signals come through us

    def forward(signum: int, _frame: object) -> None:
        for pid in list(rank_processes(proc.pid).values()) or [proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass  # exited meanwhile

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait()


def main(args: argparse.Namespace) -> int:
    from .checkpoint import WorldSizeMismatch
    from .distributed import WorldSizeError

    try:
        if args.ray or args.ray_address:
            return ray_launch(args)
        if args.nproc_per_node is not None or args.nnodes > 1:
            if args.nproc_per_node is None:
                raise WorldSizeError("--nnodes needs --nproc-per-node (ranks on each machine)")
            return launch(args)
        return run_rank(args)
    except (WorldSizeMismatch, WorldSizeError) as exc:
        print(f"squall trainer: {exc}", file=sys.stderr)
        return EXIT_BAD_WORLD


def ray_launch(args: argparse.Namespace) -> int:
    """The ranks as Ray Train workers (trainer/ray_launch.py); the exit code."""
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging

    from .checkpoint import CheckpointStore
    from .ray_launch import RayLaunchError
    from .ray_launch import launch as launch_on_ray

    if args.nproc_per_node is not None:
        print("squall trainer: --ray starts the ranks itself: drop --nproc-per-node", file=sys.stderr)
        return EXIT_BAD_WORLD
    config = config_from_args(args)
    configure_logging("trainer", config.run.name, level=config.run.log_level)
    CheckpointStore.check_world_size(Path(config.run.dir) / "checkpoints", args.workers)
    try:
        return launch_on_ray(config, config.trainer.backend, workers=args.workers, address=args.ray_address)
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

    from .main import run

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

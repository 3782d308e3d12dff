"""`squall trainer --nproc-per-node N [--nnodes M --node-rank K --rdzv-endpoint HOST:PORT]`:
the trainer's ranks on this node, started through torchrun.

`launch_torchrun` runs torchrun (`python -m torch.distributed.run`), which starts N ranks each
running `squall trainer --config` (the other options go by the environment,
`rank_environment`), and passes SIGTERM/SIGINT to the ranks, which `rank_processes` finds.
The Ray launcher is launch_ray.py; how the ranks work together is distributed.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


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
    from squall.shared.cliargs import field_flags

    given = {"SQUALL_RUN__NAME": args.run, "SQUALL_RUN__REDIS_URL": args.redis_url}
    for section, fields in field_flags(args).items():
        for name, value in fields.items():
            given[f"SQUALL_{section.upper()}__{name.upper()}"] = value
    return {**os.environ, **{env: str(value) for env, value in given.items() if value is not None}}


def rank_processes(pid: int) -> dict[int, int]:
    """Global rank -> pid of the trainer ranks below process `pid` (torchrun's children): the
    descendants with RANK in their environment whose parent has none (a rank's own children
    inherit its RANK)."""
    import psutil

    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    ranks: dict[int, int] = {}  # pid -> rank
    parents: dict[int, int] = {}
    for proc in below:
        try:
            rank = proc.environ().get("RANK")
            parents[proc.pid] = proc.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # gone meanwhile, or not ours to read
        if rank is not None:
            ranks[proc.pid] = int(rank)
    return {rank: p for p, rank in ranks.items() if parents[p] not in ranks}


def launch_torchrun(args: argparse.Namespace) -> int:
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

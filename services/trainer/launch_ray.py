"""`squall trainer --ray [--ray-address ADDR] --workers N`: the trainer's ranks on a Ray cluster.

Ray Train's TorchTrainer starts N workers (Ray actors, one GPU each with trainer.device cuda),
joins them in one torch.distributed process group (gloo on CPU, NCCL on GPUs) and sets RANK,
WORLD_SIZE and LOCAL_RANK as torchrun would. Each worker then runs the same entry as a torchrun
rank, trainer.run: distributed.init_world finds the group already set up, rank 0 runs the Trainer
(it owns the bus) and the others follow it. Nothing else differs from a torchrun launch.

Without --ray-address a Ray cluster of this machine alone is started for the run; with one, the
address is checked (a TCP connect with a deadline) before Ray is asked to join it, because Ray's
own connect retries for minutes.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from squall.shared.config import RunConfig

CONNECT_TIMEOUT_S = 5.0  # a cluster address that does not answer within this is refused
DEFAULT_GCS_PORT = 6379  # Ray's head port when an address names none


class RayLaunchError(RuntimeError):
    """The Ray cluster cannot be reached or cannot run the ranks; the message says what to do."""


def require_ray() -> None:
    try:
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise RayLaunchError(
            "--ray needs Ray Train: pip install 'squall[ray]' (or 'ray[train]'), or launch the ranks "
            "with --nproc-per-node (torchrun)"
        ) from None


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """RayLaunchError unless something accepts TCP connections at the cluster address
    (HOST[:PORT], or ray://HOST:PORT for Ray Client) within timeout_s."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", str(DEFAULT_GCS_PORT))
    if not host or not port.isdigit():
        raise RayLaunchError(
            f"--ray-address {address!r} is not HOST:PORT (or ray://HOST:PORT): pass the head node's "
            "address as `ray start --head` printed it"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise RayLaunchError(
            f"no Ray cluster answers at {address!r} ({exc}): start one there (`ray start --head "
            f"--port {port}`), pass the address its head printed, or leave --ray-address out to run "
            "on a Ray cluster of this machine alone"
        ) from None


def connect(address: str | None, workers: int) -> None:
    """Join the cluster at `address`, or start one on this machine with a CPU per worker."""
    import os

    # squall does not opt its users into Ray's usage reporting (it phones home from the head
    # node it starts); RAY_USAGE_STATS_ENABLED=1 in the environment opts in.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    if address:
        check_address(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            raise RayLaunchError(f"Ray could not join the cluster at {address!r}: {exc}") from None
        return
    # Each worker reserves one CPU: a machine with fewer cores still runs them (time-shared).
    ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True)


def run_on_workers(
    fn: Callable[[dict[str, Any]], Any],
    loop_config: dict[str, Any],
    *,
    workers: int,
    use_gpu: bool,
    storage: Path,
    name: str,
    timeout_s: float,
) -> Any:
    """`fn(loop_config)` on `workers` Ray Train workers joined in one process group (collectives
    time out after timeout_s); Ray's Result. A worker that raises fails the whole run (no
    restarts: a restarted trainer resumes from its checkpoint, as after any crash)."""
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if workers < 1:
        raise RayLaunchError(f"--workers {workers}: at least 1 worker is needed")
    trainer = TorchTrainer(
        fn,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=int(timeout_s)),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        run_config=RayRunConfig(
            name=name, storage_path=str(storage.resolve()), failure_config=FailureConfig(max_failures=0)
        ),
    )
    return trainer.fit()


def trainer_rank(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: the trainer entry every torchrun rank runs."""
    import os

    import torch

    from squall.shared.logs import configure_logging

    from .trainer import run

    config = loop_config["config"]
    configure_logging("trainer", config.run.name, level=config.run.log_level)
    torch.set_num_threads(int(os.environ.get("SQUALL_TORCH_THREADS", "1")))  # as run_rank does

    code = run(config, loop_config["backend"])
    if code != 0:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"trainer rank {rank} stopped with exit code {code} (its log says why)")


def launch_ray(config: RunConfig, backend: str | None, *, workers: int, address: str | None) -> int:
    """Run the trainer on `workers` Ray workers until rank 0 stops; the exit code."""
    from .distributed import resolve_device

    require_ray()
    from ray.train import TrainingFailedError

    use_gpu = resolve_device(config.trainer.device).type == "cuda"
    connect(address, workers)
    loop_config = {"config": config, "backend": backend}
    try:
        run_on_workers(
            trainer_rank,
            loop_config,
            workers=workers,
            use_gpu=use_gpu,
            storage=Path(config.run.dir) / "ray",
            name=f"trainer-{config.run.name}",
            timeout_s=config.trainer.collective_timeout_s
            + config.run.redis_outage_s,  # as the control group's
        )
    except TrainingFailedError as exc:  # it carries the failing rank's traceback
        print(f"squall trainer: a Ray worker failed: {exc}", file=sys.stderr)
        return 1
    return 0

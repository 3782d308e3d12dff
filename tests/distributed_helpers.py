"""Run a function on N real processes that form a gloo process group (CPU), as torchrun would.

    results = run_world(fn, arg1, arg2, world_size=2)   # [rank 0's return, rank 1's return]

`fn` must be importable by name (a module-level function of a test module or a helper): the
ranks are spawned processes. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT like a torchrun child, torch with one thread, and the trainer's process group
(squall.trainer.distributed.init_world on CPU) already joined; the group is left after `fn`.
Return values travel back pickled (keep them small: tensors of the tiny model are fine).
A rank that raises or dies fails the call with its rank and traceback; the whole world is
killed past `timeout_s`.

`assert_weights_close(expected, got)` compares two state dicts the way the world-size tests
do: per tensor, ||got - expected|| <= 1e-5 ||expected|| (an element-wise tolerance would fail
on weights near zero, where a summation order moves the last bits).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

COLLECTIVE_TIMEOUT_S = 60.0  # a rank stuck in a collective raises after this


class RankFailed(AssertionError):
    """A rank raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun sets for one rank of a one-node world."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: Any) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    try:
        import torch

        torch.set_num_threads(1)
        from squall.trainer import distributed

        distributed.init_world("cpu", COLLECTIVE_TIMEOUT_S)
        try:
            # plain pickle bytes: a tensor put on the queue as is would live in this
            # process's shared memory, gone once it exits
            out.put(("ok", rank, pickle.dumps(fn(*args))))
        finally:
            distributed.shutdown()
    except BaseException:  # reported to the parent, which fails the test with it
        out.put(("error", rank, traceback.format_exc()))


def run_world(fn: Callable, *args: Any, world_size: int = 2, timeout_s: float = 180.0) -> list[Any]:
    """`fn(*args)` on every rank of a fresh gloo world; the return values in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, out), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout_s}s"
                )
            try:
                status, rank, value = out.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RankFailed(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                continue
            if status == "error":
                raise RankFailed(f"rank {rank} raised:\n{value}")
            results[rank] = pickle.loads(value)
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return [results[rank] for rank in range(world_size)]


def assert_weights_close(
    expected: dict[str, Any], got: dict[str, Any], rel: float = 1e-5, before: dict[str, Any] | None = None
) -> None:
    """Same names, and every tensor within `rel` of the expected one, by norm: relative to the
    tensor, or with `before` (the weights before the step) relative to the step's update, which
    is what a wrong reduction would get wrong."""
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for name, tensor in expected.items():
        error = float((got[name].double() - tensor.double()).norm())
        reference = tensor.double() if before is None else tensor.double() - before[name].double()
        scale = float(reference.norm())
        assert error <= rel * max(scale, 1e-12), (
            f"{name}: relative error {error / max(scale, 1e-12):.3g} > {rel}"
        )

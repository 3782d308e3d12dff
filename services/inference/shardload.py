"""Reading a sharded weight version (shared.weightfiles has the contract) for an engine.

Shards are read by a small thread pool, a few ahead of the one being loaded: each worker reads
a shard's bytes once, checks their sha256 against the index, and deserialises them (file
reads, hashlib and safetensors release the GIL). The caller gets one shard's tensors at a
time, in shard order, and copies them into its model before the next: a version never sits
in memory whole beside the model. Every failure is a WeightsError whose text starts with the
reason (missing, checksum, format, load), as the follower counts them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from squall.shared.errors import WeightsError
from squall.shared.weightfiles import ShardIndex, check_shard, sha256_bytes, sha256_file

LOAD_THREADS = 4  # shards read and verified at once (and so at most this many in memory)


def read_shard(folder: Path, shard: str, index: ShardIndex, *, device: str = "cpu") -> dict[str, Any]:
    """One shard's tensors, after its bytes matched the index's sha256."""
    from safetensors.torch import load

    path = folder / shard
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"missing: shard {path} cannot be read ({exc.strerror or exc})") from None
    check_shard(folder, shard, sha256_bytes(data), index)
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises several types for a bad file
        raise WeightsError(f"load: shard {path} is not readable safetensors: {exc}") from None
    if set(tensors) != index.tensors_of(shard):
        raise WeightsError(f"format: shard {path} holds other tensors than its index lists")
    return {name: tensor.to(device) for name, tensor in tensors.items()} if device != "cpu" else tensors


def iter_shards(
    folder: str | Path, index: ShardIndex, *, device: str = "cpu", threads: int = LOAD_THREADS
) -> Iterator[dict[str, Any]]:
    """Each shard's verified tensors in shard order, read `threads` at a time ahead of the
    consumer; the first failure is raised and the reads not yet started are dropped."""
    folder = Path(folder)
    pending = deque(index.shards)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-read") as pool:
        ahead: deque[Future] = deque()
        try:
            while pending or ahead:
                while pending and len(ahead) < threads:
                    ahead.append(pool.submit(read_shard, folder, pending.popleft(), index, device=device))
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


def verify_shards(folder: str | Path, index: ShardIndex, *, threads: int = LOAD_THREADS) -> None:
    """Every shard present with the sha256 its index lists, hashed in parallel. For engines that
    load in place (vLLM), which must know a version is whole before changing any weight."""
    folder = Path(folder)

    def verify(shard: str) -> None:
        path = folder / shard
        try:
            actual = sha256_file(path)
        except OSError as exc:
            raise WeightsError(f"missing: shard {path} cannot be read ({exc.strerror or exc})") from None
        check_shard(folder, shard, actual, index)

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-verify") as pool:
        list(pool.map(verify, index.shards))

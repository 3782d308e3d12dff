"""Reading a sharded weight version (shared.weightfiles has the contract) for an engine.

Shards are checked by a small thread pool, a few ahead of the one being loaded: each worker
hashes a shard file against the sha256 its index lists (file reads and hashlib release the
GIL), then opens it with safetensors' memory map, which costs no copy. The caller gets one
shard's tensors at a time, in shard order, and copies them into its model before the next:
the bytes come from the page cache the hash just filled, and a version never sits in memory
whole beside the model. (Reading each shard into one bytes object and deserialising that
instead made a 0.5B reload twice as slow here: three fresh copies of every shard.) Every failure is a WeightsError whose text starts with the
reason (missing, checksum, format, load), as the follower counts them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from squall.shared.errors import WeightsError
from squall.shared.weightfiles import ShardIndex, check_shard, sha256_file

LOAD_THREADS = 4  # shards hashed at once, ahead of the one being copied into the model


def read_shard(
    folder: Path, shard: str, index: ShardIndex, *, device: str = "cpu", verify: bool = True
) -> dict[str, Any]:
    """One shard's tensors (memory-mapped on CPU), after its file matched the index's sha256
    (`verify=False`: the caller hashed every shard already)."""
    from safetensors.torch import load_file

    path = folder / shard
    if verify:
        verify_shard(folder, shard, index)
    try:
        tensors = load_file(path, device=device)
    except FileNotFoundError:
        raise WeightsError(f"missing: shard {path} does not exist") from None
    except Exception as exc:  # safetensors raises several types for a bad file
        raise WeightsError(f"load: shard {path} is not readable safetensors: {exc}") from None
    if set(tensors) != index.tensors_of(shard):
        raise WeightsError(f"format: shard {path} holds other tensors than its index lists")
    return tensors


def iter_shards(
    folder: str | Path,
    index: ShardIndex,
    *,
    device: str = "cpu",
    threads: int = LOAD_THREADS,
    verify: bool = True,
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
                    ahead.append(
                        pool.submit(
                            read_shard, folder, pending.popleft(), index, device=device, verify=verify
                        )
                    )
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


def verify_shards(folder: str | Path, index: ShardIndex, *, threads: int = LOAD_THREADS) -> None:
    """Every shard present with the sha256 its index lists, hashed in parallel. For engines that
    load in place (vLLM), which must know a version is whole before changing any weight."""
    folder = Path(folder)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="shard-verify") as pool:
        list(pool.map(lambda shard: verify_shard(folder, shard, index), index.shards))


def verify_shard(folder: Path, shard: str, index: ShardIndex) -> None:
    path = folder / shard
    try:
        actual = sha256_file(path)
    except OSError as exc:
        raise WeightsError(f"missing: shard {path} cannot be read ({exc.strerror or exc})") from None
    check_shard(folder, shard, actual, index)

"""Writing one weight version in the sharded layout (shared.weightfiles has the contract).

The state dict is cut into shards of at most `shard_bytes` in its own key order (the same
plan whatever the thread count), and the shards are written, fsynced and hashed by a thread
pool: safetensors' file writer, fsync and hashlib release the GIL, so shards proceed side by
side. The index goes last, then the whole folder, written under a temporary
name beside the final one, is renamed into place: a reader sees no version folder or a
complete one, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from squall.shared.weightfiles import (
    INDEX_FILE,
    ShardIndex,
    plan_shards,
    sha256_bytes,
    sha256_file,
    shard_name,
)

from .checkpoint import fsync_dir


def write_sharded(final: Path, state: dict[str, Any], *, shard_bytes: int, threads: int) -> str:
    """Write `state` as shards + index into the folder `final` (replacing one left by an
    earlier attempt at the same version); returns the index's sha256, the announced checksum."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        sizes = [(name, tensor.numel() * tensor.element_size()) for name, tensor in state.items()]
        plan = plan_shards(sizes, shard_bytes)
        names = [shard_name(i + 1, len(plan)) for i in range(len(plan))]
        # One key only: safetensors keeps the header metadata in a Rust HashMap, whose order
        # (and so the shard's bytes) would vary from run to run with two.
        metadata = {"format": "pt"}

        def write(i: int) -> str:
            return write_shard(tmp / names[i], {key: state[key] for key in plan[i]}, metadata)

        with ThreadPoolExecutor(max(1, min(threads, len(plan))), thread_name_prefix="shard-write") as pool:
            sums = list(pool.map(write, range(len(plan))))
        index = ShardIndex(
            weight_map={key: names[i] for i, keys in enumerate(plan) for key in keys},
            shard_sha256=dict(zip(names, sums, strict=True)),
            total_size=sum(size for _, size in sizes),
        )
        raw = index.to_bytes()
        write_durably(tmp / INDEX_FILE, raw)
        fsync_dir(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sha256_bytes(raw)


def write_shard(path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> str:
    """One shard written durably; returns its sha256. safetensors writes straight from the
    tensors' memory (no serialised copy: a shard costs no extra RAM), so the hash reads the
    file back, from the page cache."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    return sha256_file(path)


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. A `final` already there (a version re-written after a crash
    before its announcement) is moved aside first, then removed."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)

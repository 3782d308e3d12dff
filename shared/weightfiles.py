"""The weight-file contract between the trainer (writer) and inference nodes (readers):
where a version's file lives and how its checksum is computed. One definition, both sides."""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH_CHUNK = 1 << 22  # bytes read at a time while hashing: bounded memory for multi-GB files


def version_dir(run_dir: str | Path, version: int) -> Path:
    """`{run.dir}/weights/v{version:06d}`: the folder holding one version's model.safetensors."""
    return Path(run_dir) / "weights" / f"v{version:06d}"


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, the `checksum` of a WeightVersion."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()

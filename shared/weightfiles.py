"""The weight-file contract between the trainer (writer) and inference nodes (readers):
where a version's files live, how they are named and how their checksums are computed. One
definition, both sides.

Two layouts of `{run.dir}/weights/v{N:06d}/`, named by `WeightVersion.format`:
- "safetensors" (runs before sharding): one `model.safetensors`; `location` is that file and
  `checksum` its sha256.
- "safetensors-sharded": Hugging Face's sharded layout, `model-00001-of-0000K.safetensors` ...
  plus `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {tensor: shard}});
  `location` is the folder and `checksum` the sha256 of the index file, whose metadata lists
  every shard's sha256 (`shard_sha256`). One checksum on the wire covers every byte: the index
  is checked against the announcement, each shard against the index.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import WeightsError

HASH_CHUNK = 1 << 22  # bytes read at a time while hashing: bounded memory for multi-GB files
WEIGHTS_FILE = "model.safetensors"  # the single-file layout
INDEX_FILE = "model.safetensors.index.json"  # the sharded layout's index
FORMAT_FILE = "safetensors"
FORMAT_SHARDED = "safetensors-sharded"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def version_dir(run_dir: str | Path, version: int) -> Path:
    """`{run.dir}/weights/v{version:06d}`: the folder holding one version's weight files."""
    return Path(run_dir) / "weights" / f"v{version:06d}"


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, the `checksum` of a WeightVersion."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def shard_name(number: int, total: int) -> str:
    """Shard `number` (1-based) of `total`, as Hugging Face names them."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names (in the given order, with their byte sizes) cut into consecutive shards of
    at most `max_bytes` each; a tensor larger than that gets a shard of its own. Same input,
    same plan: the trainer's layout does not depend on how many threads write it."""
    shards: list[list[str]] = []
    filled = max_bytes  # start a new shard with the first tensor
    for name, size in sizes:
        if filled + size > max_bytes and (not shards or shards[-1]):
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return [names for names in shards if names]


@dataclass(frozen=True)
class ShardIndex:
    """The parsed `model.safetensors.index.json` of a sharded version."""

    weight_map: dict[str, str]  # tensor name -> shard file holding it
    shard_sha256: dict[str, str]  # shard file -> its sha256 hex
    total_size: int  # bytes of tensor data in all shards (Hugging Face's metadata.total_size)

    @property
    def shards(self) -> list[str]:
        return sorted(self.shard_sha256)

    def tensors_of(self, shard: str) -> set[str]:
        return {name for name, file in self.weight_map.items() if file == shard}

    def to_bytes(self) -> bytes:
        """The index file's bytes: sorted keys, so the same shards give the same checksum."""
        doc = {
            "metadata": {"total_size": self.total_size, "shard_sha256": self.shard_sha256},
            "weight_map": self.weight_map,
        }
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> ShardIndex:
        """Validate an index file's bytes; WeightsError starting "format:" naming what is wrong."""
        try:
            doc = json.loads(raw)
            metadata, weight_map = doc["metadata"], doc["weight_map"]
            sums, total = metadata["shard_sha256"], metadata["total_size"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(
                f"format: {where} is not a squall shard index (needs metadata.shard_sha256, "
                f"metadata.total_size and weight_map): {exc!r}"
            ) from None
        index = cls(weight_map=weight_map, shard_sha256=sums, total_size=total)
        index._check(where)
        return index

    def _check(self, where: str) -> None:
        problems = []
        if not isinstance(self.total_size, int) or not self.weight_map:
            problems.append("total_size must be an integer and weight_map non-empty")
        names = self.shards
        if names != [shard_name(i + 1, len(names)) for i in range(len(names))]:
            problems.append(
                f"shards must be model-00001-of-{len(names):05d}.safetensors ..., got {names[:3]}"
            )
        if bad := [n for n, h in self.shard_sha256.items() if not SHA256_HEX.match(str(h))]:
            problems.append(f"shard_sha256 of {bad[:3]} is not a lowercase sha256 hex")
        if unlisted := sorted(set(self.weight_map.values()) - set(names)):
            problems.append(f"weight_map names shards without a checksum: {unlisted[:3]}")
        if empty := sorted(set(names) - set(self.weight_map.values())):
            problems.append(f"shards holding no tensor: {empty[:3]}")
        if problems:
            raise WeightsError(f"format: {where}: " + "; ".join(problems))


def read_index(folder: str | Path, checksum: str | None = None) -> ShardIndex:
    """The index of the sharded version in `folder`, checked against the announced `checksum`
    when given. WeightsError whose text starts with the reason: missing, checksum, format."""
    path = Path(folder) / INDEX_FILE
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise WeightsError(f"missing: {path} cannot be read ({exc.strerror or exc})") from None
    if checksum is not None and (actual := sha256_bytes(raw)) != checksum.lower():
        raise WeightsError(f"checksum: {path} has sha256 {actual}, announced {checksum}")
    return ShardIndex.parse(raw, str(path))


def check_shard(folder: str | Path, shard: str, actual: str, index: ShardIndex) -> None:
    """Raise WeightsError ("checksum: ...") when a shard's sha256 is not the one its index lists."""
    if actual != index.shard_sha256[shard]:
        raise WeightsError(
            f"checksum: shard {Path(folder) / shard} has sha256 {actual}, its index lists "
            f"{index.shard_sha256[shard]} (the file was changed or truncated after publication)"
        )

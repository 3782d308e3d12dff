"""Weight publication: each version written durably (sharded safetensors + index by default,
shardwrite.py; or one model.safetensors, `trainer.weights_format`), checksummed, then
announced as WeightVersion on `weights`; old versions pruned only once every inference node
acknowledged a newer one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import redis

from squall.shared import bus
from squall.shared.adapterfiles import ADAPTER_CONFIG, ADAPTER_WEIGHTS, FORMAT_LORA, adapter_checksum
from squall.shared.keys import WEIGHTS_MAXLEN, Keys
from squall.shared.roles import DEFAULT_ROLE, trainer_field
from squall.shared.schemas import WeightVersion
from squall.shared.weightfiles import FORMAT_SHARDED, WEIGHTS_FILE, sha256_bytes, sha256_file, version_dir

from .checkpoint import fsync_dir
from .shardwrite import replace_dir, write_durably, write_sharded

MIB = 1 << 20
VERSION_DIR = re.compile(r"^v(\d{6,})$")


class Publisher:
    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        run_dir: str | Path,
        *,
        keep_versions: int,
        weights_format: str = FORMAT_SHARDED,
        shard_bytes: int = 512 * MIB,
        write_threads: int = 4,
        adapter_config: dict[str, Any] | None = None,
        role: str = DEFAULT_ROLE,
    ) -> None:
        self.r, self.keys = r, keys
        self.role = role  # versions count per role; each role's run_dir is its own (multirole.py)
        self.root = Path(run_dir) / "weights"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.weights_format, self.shard_bytes, self.write_threads = weights_format, shard_bytes, write_threads
        self.adapter_config = adapter_config  # LoRA: every version is this adapter's new tensors
        if adapter_config is not None:
            self.weights_format = FORMAT_LORA
        for stale in self.root.glob(".v*.tmp-*"):  # a sharded write a crash cut short
            shutil.rmtree(stale, ignore_errors=True)

    def published_version(self) -> int | None:
        """The version the trainer last announced (versions hash field `trainer`, or
        `trainer:<role>`)."""
        raw = self.r.hget(self.keys.versions, trainer_field(self.role))
        return int(raw) if raw is not None else None

    def write(self, version: int, state: dict[str, Any]) -> tuple[Path, str]:
        """Write the weights of `version` durably; returns (location, checksum) as announced:
        the folder and its index's sha256 (sharded), or the file and its sha256."""
        from safetensors.torch import save_file

        folder = version_dir(self.root.parent, version)
        if self.adapter_config is not None:
            return folder, write_adapter(folder, state, self.adapter_config, version=version)
        if self.weights_format == FORMAT_SHARDED:
            checksum = write_sharded(folder, state, shard_bytes=self.shard_bytes, threads=self.write_threads)
            return folder, checksum
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / WEIGHTS_FILE
        tmp = folder / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
        save_file(state, str(tmp), metadata={"format": "pt", "version": str(version)})
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.rename(tmp, final)
        fsync_dir(folder)
        return final, sha256_file(final)

    def publish(self, version: int, step: int, state: dict[str, Any]) -> WeightVersion:
        path, checksum = self.write(version, state)
        message = WeightVersion(
            run=self.keys.run,
            version=version,
            step=step,
            location=str(path.resolve()),
            checksum=checksum,
            format=self.weights_format,
            role=self.role,
        )
        bus.publish(self.r, self.keys.weights, message, maxlen=WEIGHTS_MAXLEN)
        self.r.hset(self.keys.versions, trainer_field(self.role), version)
        return message

    def node_versions(self) -> dict[str, int]:
        """Each node's acknowledged version of this role (`versions` fields node_field(node, role))."""
        raw = self.r.hgetall(self.keys.versions)
        out = {}
        for key, value in raw.items():
            name = key.decode()
            if not name.startswith("inference:"):
                continue
            node, _, role = name.removeprefix("inference:").partition(":")
            if (role or DEFAULT_ROLE) == self.role:
                out[name] = int(value)
        return out

    def pinned_versions(self) -> set[int]:
        """Versions snapshot nodes are pinned to (`versions` fields `snapshot:<node>`)."""
        raw = self.r.hgetall(self.keys.versions)
        return {int(v) for k, v in raw.items() if k.decode().startswith("snapshot:")}

    def on_disk(self) -> list[int]:
        out = []
        for path in self.root.iterdir():
            match = VERSION_DIR.match(path.name)
            if match and path.is_dir():
                out.append(int(match.group(1)))
        return sorted(out)

    def prune(self) -> list[int]:
        """Remove versions older than every node's acknowledged one, keeping the newest
        `keep_versions`; returns the versions removed."""
        nodes = self.node_versions()
        oldest_served = min(nodes.values()) if nodes else None
        pinned = self.pinned_versions()
        versions = self.on_disk()
        removable = versions[: max(0, len(versions) - self.keep_versions)]
        removed = []
        for version in removable:
            if oldest_served is not None and version >= oldest_served:
                break  # some node serves this one or has not acknowledged anything newer
            if version in pinned:
                continue  # a snapshot node (inference.pin_version) serves it, and only it
            shutil.rmtree(version_dir(self.root.parent, version), ignore_errors=True)
            removed.append(version)
        return removed


def write_adapter(final: Path, tensors: dict[str, Any], config: dict[str, Any], *, version: int) -> str:
    """A LoRA version in peft's layout (shared.adapterfiles) into the folder `final`: both
    files written and fsynced under a temporary folder, renamed into place whole. Returns the
    announced checksum (the manifest of both files' sha256s, hashed from memory)."""
    from safetensors.torch import save

    files = {
        ADAPTER_CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
        ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt", "version": str(version)}),
    }
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")  # removed at start if a crash leaves it
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, data in files.items():
            write_durably(tmp / name, data)
        fsync_dir(tmp)
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return adapter_checksum({name: sha256_bytes(data) for name, data in files.items()})

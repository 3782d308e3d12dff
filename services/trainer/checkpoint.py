"""Durable trainer checkpoints: write to a temp dir, fsync, rename; resume from the newest.

A checkpoint ``{run.dir}/checkpoints/ckpt-{commit:08d}/`` holds
- ``state.pt``: the backend's model, optimizer and RNG state (torch.save);
- ``meta.json``: commit, step, weight version, and the *done set*: every trajectory key this
  trainer has consumed (trained, filtered, late) and the step each trained key went into,
  and every group id completed. Stream entries are acked only after the checkpoint listing
  them is durable, so after any crash a re-delivered entry is either in the done set (ack
  and skip) or was never trained (train it now): no loss, no double training.

The rename is the commit point: a directory named ``ckpt-*`` is complete by construction;
``.tmp-*`` leftovers of a crash are removed on start.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "ckpt-"
KEEP_CHECKPOINTS = 2  # the newest and one before it, in case the newest is unreadable


@dataclass
class TrainerState:
    commit: int = 0  # checkpoints written so far
    step: int = 0  # optimizer steps taken
    version: int = 0  # newest weight version produced (0 = the initial model)
    trained: dict[str, int] = field(default_factory=dict)  # trajectory key -> step it trained in
    consumed: dict[str, str] = field(default_factory=dict)  # key -> filtered reason or 'late'
    done_groups: list[str] = field(default_factory=list)

    def is_done(self, key: str) -> bool:
        return key in self.trained or key in self.consumed

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "step": self.step,
            "version": self.version,
            "trained": self.trained,
            "consumed": self.consumed,
            "done_groups": self.done_groups,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        return cls(
            commit=int(data["commit"]),
            step=int(data["step"]),
            version=int(data["version"]),
            trained={k: int(v) for k, v in data["trained"].items()},
            consumed=dict(data["consumed"]),
            done_groups=list(data["done_groups"]),
        )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


class CheckpointStore:
    """The checkpoints folder of one run."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def list(self) -> list[Path]:
        return sorted(p for p in self.root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())

    def save(self, state: TrainerState, write_backend_state: Any) -> Path:
        """Write meta and (through `write_backend_state(path)`) the backend's state, durably."""
        final = self.root / f"{CHECKPOINT_PREFIX}{state.commit:08d}"
        tmp = self.root / f".tmp-{state.commit:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_backend_state(tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps(state.to_json()))
        for path in tmp.iterdir():
            fsync_file(path)
        fsync_dir(tmp)
        if final.exists():  # a crash after rename but before we recorded the commit: same content
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        for old in self.list()[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> tuple[TrainerState, Path] | None:
        """The newest readable checkpoint's state and folder, or None for a fresh run."""
        for path in reversed(self.list()):
            try:
                state = TrainerState.from_json(json.loads((path / "meta.json").read_text()))
            except (OSError, ValueError, KeyError):
                continue
            if (path / "state.pt").exists():
                return state, path
        return None

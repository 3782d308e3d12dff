"""Durable trainer checkpoints: write to a temp dir, fsync, rename; resume from the newest.

A checkpoint ``{run.dir}/checkpoints/ckpt-{commit:08d}/`` holds
- ``state.pt``: the backend's model, optimizer and RNG state (torch.save); with several
  ranks a folder instead: their torch.distributed.checkpoint shards and one RNG file each;
- ``meta.json``: commit, step, weight version, the world size (ranks) that wrote it, and
  the *done delta* of this commit: the
  trajectory keys it trained (key -> step), the keys it consumed without training (key ->
  filtered reason or 'late') and the group ids it closed.

The whole *done set* (everything any commit covered) is the append-only log
``checkpoints/done.jsonl``, one fsynced line per commit, plus the newest checkpoint's delta.
So a commit writes only its own keys: the checkpoint costs the same at step 10 and at step
100,000, where rewriting the whole set grew with the run.

The rename is the commit point: a directory named ``ckpt-*`` is complete by construction;
``.tmp-*`` leftovers of a crash are removed on start. The log follows the checkpoints, never
leads them: on load, lines of commits newer than the checkpoint loaded are dropped and a
missing line for it (a crash between the rename and the append) is written from its meta.
Stream entries are acked only after the checkpoint listing them is durable, so after any
crash a re-delivered entry is either in the done set (ack and skip) or was never trained
(train it now): no loss, no double training.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "ckpt-"
KEEP_CHECKPOINTS = 2  # the newest and one before it, in case the newest is unreadable
DONE_LOG = "done.jsonl"  # one line per commit: {"commit", "trained", "consumed", "groups"}


@dataclass
class DoneDelta:
    """What one commit adds to the done set."""

    trained: dict[str, int] = field(default_factory=dict)  # trajectory key -> step it trained in
    consumed: dict[str, str] = field(default_factory=dict)  # key -> filtered reason or 'late'
    groups: list[str] = field(default_factory=list)  # group ids closed by this commit

    def to_json(self) -> dict[str, Any]:
        return {"trained": self.trained, "consumed": self.consumed, "done_groups": self.groups}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DoneDelta:
        return cls(
            trained={k: int(v) for k, v in data["trained"].items()},
            consumed=dict(data["consumed"]),
            groups=list(data["done_groups"]),
        )


@dataclass
class TrainerState:
    """The durable state in memory: counters and the whole done set."""

    commit: int = 0  # checkpoints written so far
    step: int = 0  # optimizer steps taken
    version: int = 0  # newest weight version produced (0 = the initial model)
    version_step: int = 0  # the step `version` was produced at (-1: unknown, an older checkpoint)
    trained: dict[str, int] = field(default_factory=dict)  # trajectory key -> step it trained in
    consumed: dict[str, str] = field(default_factory=dict)  # key -> filtered reason or 'late'
    done_groups: list[str] = field(default_factory=list)

    def is_done(self, key: str) -> bool:
        return key in self.trained or key in self.consumed

    def add(self, delta: DoneDelta) -> None:
        self.trained.update(delta.trained)
        self.consumed.update(delta.consumed)
        self.done_groups.extend(delta.groups)  # a group is closed once (the assembler's done set)

    def everything(self) -> DoneDelta:
        """The whole done set as one delta (a first save, or a state built by hand)."""
        return DoneDelta(dict(self.trained), dict(self.consumed), list(self.done_groups))

    def meta(self, delta: DoneDelta) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "step": self.step,
            "version": self.version,
            "version_step": self.version_step,
            **delta.to_json(),
        }


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _log_line(commit: int, delta: DoneDelta) -> bytes:
    return (json.dumps({"commit": commit, **delta.to_json()}) + "\n").encode()


class DoneLog:
    """``done.jsonl``: the done delta of every commit, appended and fsynced after its rename."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, commit: int, delta: DoneDelta) -> None:
        with open(self.path, "ab") as handle:
            handle.write(_log_line(commit, delta))
            handle.flush()
            os.fsync(handle.fileno())

    def read(self) -> list[tuple[int, DoneDelta]]:
        """Every readable line as (commit, delta); a torn last line is skipped."""
        if not self.path.exists():
            return []
        out = []
        for raw in self.path.read_bytes().splitlines():
            try:
                line = json.loads(raw)
                out.append((int(line["commit"]), DoneDelta.from_json(line)))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        return out

    def rewrite(self, lines: Iterable[tuple[int, DoneDelta]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as handle:
            handle.writelines(_log_line(commit, delta) for commit, delta in lines)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)


class WorldSizeMismatch(ValueError):
    """The newest checkpoint was written by another number of ranks than this trainer has."""

    def __init__(self, path: Path, written: int, now: int) -> None:
        super().__init__(
            f"checkpoint {path} was written by a trainer with {written} rank(s), this one has {now}: "
            f"resume it with {written} rank(s) (squall trainer --nproc-per-node, times --nnodes, = {written}), "
            "or start a new run.dir; sharded checkpoints are not converted between world sizes"
        )


class CheckpointStore:
    """The checkpoints folder of one run, written by a trainer of `world_size` ranks."""

    def __init__(self, root: str | Path, world_size: int = 1) -> None:
        self.root = Path(root)
        self.world_size = world_size
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(".tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        self.log = DoneLog(self.root / DONE_LOG)

    def list(self) -> list[Path]:
        return sorted(p for p in self.root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())

    def save(
        self,
        state: TrainerState,
        write_backend_state: Callable[[Path], Any],
        delta: DoneDelta | None = None,
    ) -> Path:
        """Write `state`'s counters, `delta` (what this commit adds to the done set; None: the
        whole set) and, through `write_backend_state(path)`, the backend's state, durably."""
        delta = state.everything() if delta is None else delta
        final = self.root / f"{CHECKPOINT_PREFIX}{state.commit:08d}"
        tmp = self.root / f".tmp-{state.commit:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_backend_state(tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({**state.meta(delta), "world_size": self.world_size}))
        for path in tmp.iterdir():  # a sharded state is a folder its writers fsynced
            if path.is_dir():
                fsync_dir(path)
            else:
                fsync_file(path)
        fsync_dir(tmp)
        if final.exists():  # a crash after rename but before we recorded the commit: same content
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        self.log.append(state.commit, delta)
        for old in self.list()[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def check_world_size(root: str | Path, world_size: int) -> None:
        """WorldSizeMismatch when the newest checkpoint under `root` was written by another
        number of ranks (read-only: what a launcher checks before starting any rank)."""
        for path in sorted(Path(root).glob(f"{CHECKPOINT_PREFIX}*"), reverse=True):
            try:
                written = int(json.loads((path / "meta.json").read_text()).get("world_size", 1))
            except (OSError, ValueError, AttributeError):
                continue
            if written != world_size:
                raise WorldSizeMismatch(path, written, world_size)
            return

    def latest(self) -> tuple[TrainerState, Path] | None:
        """The newest readable checkpoint's state (with the whole done set) and folder, or
        None for a fresh run. WorldSizeMismatch when another number of ranks wrote it."""
        for path in reversed(self.list()):
            try:
                meta = json.loads((path / "meta.json").read_text())
                commit, delta = int(meta["commit"]), DoneDelta.from_json(meta)
                state = TrainerState(
                    commit=commit,
                    step=int(meta["step"]),
                    version=int(meta["version"]),
                    version_step=int(meta.get("version_step", -1)),
                )
            except (OSError, ValueError, KeyError):
                continue
            written = int(meta.get("world_size", 1))  # older checkpoints: one process
            if written != self.world_size and (path / "state.pt").exists():
                raise WorldSizeMismatch(path, written, self.world_size)
            if (path / "state.pt").exists():
                self._replay_log(state, delta)
                return state, path
        return None

    def _replay_log(self, state: TrainerState, newest: DoneDelta) -> None:
        """Fill `state`'s done set from the log up to its commit, and make the log end with
        exactly that commit's line."""
        lines = self.log.read()
        kept = [(commit, delta) for commit, delta in lines if commit < state.commit]
        for _, delta in kept:
            state.add(delta)
        state.add(newest)
        state.done_groups = list(dict.fromkeys(state.done_groups))  # whole-set saves repeat groups
        if not lines or lines[-1][0] != state.commit or len(kept) != len(lines) - 1:
            self.log.rewrite([*kept, (state.commit, newest)])

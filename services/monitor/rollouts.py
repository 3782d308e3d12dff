"""Rollouts kept for reading after the fact: a bounded sample per weight version in the run
folder, and the live `trajectories` stream, read as one list of attempts.

Why a sample is kept: `trajectories` is trimmed (by the scheduler, every
`scheduler.trim_every_s`) below the oldest entry its groups have not acknowledged, so an
attempt leaves Redis seconds after the trainer and the scheduler have both read it. The
scheduler, which sees every trajectory with its group's task payload, appends the first
`scheduler.keep_rollouts_per_version` attempts of each version to
`<run.dir>/rollouts/v<version>.msgpack` (one msgpack record per attempt: the stream entry id,
the task payload and the encoded Trajectory). That file is what `squall show`, the dashboard's
trajectory viewer and `squall rescore` read once a run is over; while it runs, they read the
live stream too (a live entry's payload is found in the kept record or the open group).

A record read twice (a scheduler that crashed after keeping it handles the entry again) is
read once: attempts are keyed by `task_id#attempt`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from squall.shared import schemas

FOLDER = "rollouts"
FILE_PATTERN = "v{version:06d}.msgpack"


@dataclass(frozen=True)
class Rollout:
    """One attempt as the viewer and rescoring read it."""

    trajectory: schemas.Trajectory
    payload: dict[str, Any] | None  # the task given to the agent (None: not known here)
    entry: str  # its id in `trajectories` (its time: when it finished)
    source: str  # "kept" (the run folder) or "live" (the stream)

    @property
    def key(self) -> str:
        return self.trajectory.key

    @property
    def version(self) -> int:
        return policy_version(self.trajectory)


def policy_version(trajectory: schemas.Trajectory) -> int:
    """The version that sampled an attempt: the newest among its trained turns (else min_version)."""
    versions = [t.version for t in trajectory.turns if t.trained and t.version >= 0]
    return max(versions) if versions else trajectory.min_version


class _Record(msgspec.Struct):
    entry: str
    payload: dict[str, Any] | None
    trajectory: bytes  # schemas.encode(Trajectory)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record)


def folder_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / FOLDER


class RolloutKeeper:
    """Appends up to `per_version` attempts of each version to the run folder (0: keeps none).

    Counts per version are read from the files on first use, so a restarted scheduler keeps
    filling the same bound instead of starting again."""

    def __init__(self, run_dir: str | Path, per_version: int) -> None:
        self.folder = folder_of(run_dir)
        self.per_version = per_version
        self.kept: dict[int, int] = {}

    def _count(self, path: Path) -> int:
        return sum(1 for _ in _read_file(path)) if path.exists() else 0

    def keep(self, trajectory: schemas.Trajectory, payload: dict[str, Any] | None, entry: str) -> bool:
        """Append this attempt unless its version's sample is full; True when kept."""
        if self.per_version <= 0:
            return False
        version = policy_version(trajectory)
        path = self.folder / FILE_PATTERN.format(version=max(version, 0))
        if version not in self.kept:
            self.kept[version] = self._count(path)
        if self.kept[version] >= self.per_version:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        body = _encoder.encode(_Record(entry=entry, payload=payload, trajectory=schemas.encode(trajectory)))
        with open(path, "ab") as out:  # one write of length + record: a torn tail is skipped on read
            out.write(len(body).to_bytes(4, "little") + body)
            out.flush()
            os.fsync(out.fileno())
        self.kept[version] += 1
        return True


def _read_file(path: Path) -> Iterator[_Record]:
    data = path.read_bytes()
    at = 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + size > len(data):
            return  # a torn last write (a crash mid-append): the records before it stand
        try:
            yield _decoder.decode(data[at + 4 : at + 4 + size])
        except msgspec.DecodeError:
            return
        at += 4 + size


def read_kept(run_dir: str | Path) -> Iterator[Rollout]:
    """Every kept attempt, oldest version first; a record that does not decode is skipped."""
    folder = folder_of(run_dir)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("v*.msgpack")):
        for record in _read_file(path):
            try:
                trajectory = schemas.decode(record.trajectory, schemas.Trajectory)
            except Exception:
                continue
            yield Rollout(trajectory, record.payload, record.entry, "kept")


def read_live(r: Any, keys: Any, payloads: dict[str, dict[str, Any]] | None = None) -> Iterator[Rollout]:
    """The attempts still in `trajectories` (not yet trimmed), oldest first; `payloads`: group id
    -> task payload where known (the open groups)."""
    payloads = payloads or {}
    for entry_id, fields in r.xrange(keys.trajectories):
        try:
            trajectory = schemas.decode(fields[schemas.ENTRY_FIELD], schemas.Trajectory)
        except Exception:
            continue
        entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        yield Rollout(trajectory, payloads.get(trajectory.group_id), entry, "live")


def open_group_payloads(r: Any, keys: Any) -> dict[str, dict[str, Any]]:
    import json

    out = {}
    for group_id, raw in r.hgetall(keys.groups).items():
        try:
            out[group_id.decode()] = json.loads(raw)["payload"]
        except (ValueError, KeyError, TypeError):
            continue
    return out


def read_all(run_dir: str | Path | None, r: Any = None, keys: Any = None) -> list[Rollout]:
    """Kept and live attempts, one per key (a kept record wins: it carries the payload)."""
    found: dict[str, Rollout] = {}
    if run_dir is not None:
        for rollout in read_kept(run_dir):
            found.setdefault(rollout.key, rollout)
    if r is not None and keys is not None:
        for rollout in read_live(r, keys, open_group_payloads(r, keys)):
            found.setdefault(rollout.key, rollout)
    return sorted(found.values(), key=lambda x: x.entry)

"""The tracker's cursor: where it stopped in each stream, so a restart does not log twice.

One JSON file, `{tracking.dir}/cursor.json`, replaced atomically (temp file, fsync, rename)
after every poll whose records the backends flushed. It also keeps each backend's own run id
(W&B run id, MLflow run id) so a restarted tracker appends to the same tracked run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from squall.shared.errors import ConfigError

CURSOR_FILE = "cursor.json"
SAMPLED_VERSIONS_KEPT = 64  # per-version sample counts remembered (older versions get no new samples)


@dataclass
class Cursor:
    run: str  # run name the cursor belongs to; a cursor of another run is refused
    ids: dict[str, str] = field(default_factory=dict)  # short stream name -> last entry id logged
    ledger_version: int = -1  # trainer version at which the ledger counts were last logged
    ledger_counts: dict[str, int] = field(default_factory=dict)  # the counts logged then
    sampled: dict[str, int] = field(default_factory=dict)  # policy version -> samples logged
    backends: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> its resume state

    def last_id(self, stream: str) -> str:
        return self.ids.get(stream, "0-0")

    def samples_of(self, version: int) -> int:
        return self.sampled.get(str(version), 0)

    def add_samples(self, version: int, n: int) -> None:
        self.sampled[str(version)] = self.samples_of(version) + n
        newest = sorted(self.sampled, key=int)[-SAMPLED_VERSIONS_KEPT:]
        self.sampled = {v: self.sampled[v] for v in newest}


def load(folder: Path, run: str) -> Cursor:
    """The saved cursor of `run` in `folder`, or a fresh one."""
    path = folder / CURSOR_FILE
    if not path.exists():
        return Cursor(run=run)
    try:
        data = json.loads(path.read_text())
        cursor = Cursor(**data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"tracking cursor {path} is unreadable ({exc}); delete it to log the run again from its start"
        ) from None
    if cursor.run != run:
        raise ConfigError(
            f"tracking cursor {path} belongs to run {cursor.run!r}, not {run!r}: "
            "give this run its own tracking.dir (or run.dir)"
        )
    return cursor


def save(folder: Path, cursor: Cursor) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CURSOR_FILE
    tmp = folder / f".{CURSOR_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(asdict(cursor), handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)

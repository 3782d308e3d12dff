"""The end of the data: the scheduler tells the trainer that no training group is coming, and
the trainer answers once it has trained everything (one hash, `Keys.data_end`).

1. The scheduler, once the data ran out and every training group rolled out (so every
   training trajectory of the run is on `trajectories`), writes `scheduler_at` (wall clock)
   and `samples` (training samples dispatched).
2. The trainer reads the hash before each read of the stream; when `scheduler_at` is there and
   the read that follows returns nothing, it holds all the training data there will be. It
   trains what it holds as a last, smaller step (or filters it), commits, publishes, and writes
   `trainer_version`, `trainer_step` and `trainer_at`.
3. The scheduler waits for `trainer_version` (bounded by `scheduler.end_wait_s`), then runs
   the end-of-run validation round once, on exactly that version. When no answer can come (no
   trainer) or none came in time, it writes `unconfirmed_version`, the newest published one,
   and validates that instead.
A scheduler that starts with data left clears the hash (a run resumed with more data).
`redis-cli HGETALL squall:<run>:data_end` shows where the handshake stands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .keys import Keys

ROLE_ANSWER = "trainer_version:"  # + role: that role's answer (role_answer_field)


@dataclass(frozen=True)
class DataEnd:
    """The handshake as it stands (None: not written yet)."""

    scheduler_at: float | None  # when the scheduler saw the last training group roll out
    samples: int | None  # training samples it dispatched in all
    trainer_version: int | None  # the version the trainer published after training everything
    trainer_step: int | None  # its optimizer step then
    trainer_at: float | None  # when it said so
    unconfirmed_version: int | None  # the scheduler's end version taken without that answer

    @property
    def end_version(self) -> int | None:
        """The version the end-of-run validation measures (None: not settled yet)."""
        return self.trainer_version if self.trainer_version is not None else self.unconfirmed_version

    @property
    def owed_by_trainer(self) -> bool:
        """The data ended and the trainer has not answered yet."""
        return self.scheduler_at is not None and self.trainer_version is None


def _number(raw: dict[Any, Any], name: str, kind: type) -> Any:
    value = raw.get(name.encode(), raw.get(name))
    if value is None:
        return None
    try:
        return kind(value.decode() if isinstance(value, bytes) else value)
    except ValueError:
        return None  # a hand-edited field: read as not written


def read(r: Any, keys: Keys) -> DataEnd:
    raw = r.hgetall(keys.data_end) or {}
    return DataEnd(
        scheduler_at=_number(raw, "scheduler_at", float),
        samples=_number(raw, "samples", int),
        trainer_version=_number(raw, "trainer_version", int),
        trainer_step=_number(raw, "trainer_step", int),
        trainer_at=_number(raw, "trainer_at", float),
        unconfirmed_version=_number(raw, "unconfirmed_version", int),
    )


def announce_data_end(r: Any, keys: Keys, samples: int) -> bool:
    """Scheduler: no more training groups (idempotent: the first time stays). True the first time."""
    first = bool(r.hsetnx(keys.data_end, "scheduler_at", repr(time.time())))
    r.hset(keys.data_end, "samples", samples)
    return first


def announce_trained(r: Any, keys: Keys, version: int, step: int) -> None:
    """Trainer: everything trained or filtered, and `version` published."""
    r.hset(
        keys.data_end,
        mapping={"trainer_version": version, "trainer_step": step, "trainer_at": repr(time.time())},
    )


def role_answer_field(role: str) -> str:
    """A trained role's own answer (its final version) in a run with roles: the run's
    `trainer_version` is written once every role has answered."""
    return f"{ROLE_ANSWER}{role}"


def role_answers(raw: dict[Any, Any]) -> dict[str, int]:
    """Role -> the final version it answered, from the hash's fields (HGETALL)."""
    out = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else field
        if name.startswith(ROLE_ANSWER):
            out[name.removeprefix(ROLE_ANSWER)] = int(value)
    return out


def settle_unconfirmed(r: Any, keys: Keys, version: int) -> None:
    """Scheduler: no answer came (no trainer, or past end_wait_s): the end is `version`."""
    r.hset(keys.data_end, "unconfirmed_version", version)


def clear(r: Any, keys: Keys) -> None:
    """Scheduler: the run has data left (again): no end is announced."""
    r.delete(keys.data_end)

"""Validation rounds: the validation set dispatched every `val_every` trainer versions.

One round is open at a time; its groups are `val` groups (no training, ledger ok -> validated),
their rewards are summed in the cursor, and when the last one settles the round's mean becomes
one `val` RewardPoint. Once the training data has run out no periodic round starts: the end
round (`val_at_end`) waits for the trainer's last version (shared/dataend.py: everything
trained, the last partial step included, and published) and measures exactly that one, once,
so a run ends measured on its final weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import redis

from squall.shared import schemas
from squall.shared.config import SchedulerSection
from squall.shared.keys import Keys

from . import report
from .cursor import Cursor
from .dataset import Sample
from .dispatch import Dispatcher, new_group
from .groups import Group


def end_owed(
    *, val_at_end: bool, val_every: int, has_val: bool, last_val_version: int, end_version: int | None
) -> bool:
    """Is the run's end still owed something? The trainer's last version is not known yet
    (`end_version` None), or the end round on it has not run (a round on that very version
    before, periodic or not, already measured it)."""
    if end_version is None:
        return True
    return val_at_end and bool(val_every) and has_val and last_val_version < end_version


def val_round_due(
    *, val_every: int, has_val: bool, round_open: bool, last_val_version: int, version: int
) -> bool:
    """Dispatch a periodic validation round at `version` now (while training data is left)?

    The first round goes out at once, then one every `val_every` versions, one at a time.
    """
    if not val_every or not has_val or round_open:
        return False
    return last_val_version < 0 or version >= last_val_version + val_every


def end_round_due(
    *,
    val_at_end: bool,
    val_every: int,
    has_val: bool,
    round_open: bool,
    last_val_version: int,
    end_version: int | None,
) -> bool:
    """Dispatch the end round now? Only on the trainer's last version, once it is known, after
    any round still open, and not when a round already measured that version."""
    if end_version is None or round_open:
        return False
    return end_owed(
        val_at_end=val_at_end,
        val_every=val_every,
        has_val=has_val,
        last_val_version=last_val_version,
        end_version=end_version,
    )


def round_open(groups: Iterable[Group]) -> bool:
    return any(g.mode == "val" for g in groups)


class Validation:
    """Starts and closes validation rounds; the owner decides when (see `val_round_due`)."""

    def __init__(
        self, r: redis.Redis, keys: Keys, section: SchedulerSection, dispatcher: Dispatcher, log
    ) -> None:
        self.r, self.keys, self.section, self.dispatcher, self.log = r, keys, section, dispatcher, log

    def start(
        self, samples: list[Sample], cursor: Cursor, version: int, *, end: bool = False
    ) -> tuple[Cursor, list[Group]]:
        """Dispatch one round on `version` (`end`: the end-of-run round); returns the committed
        cursor and the round's groups."""
        cursor = cursor.copy()
        cursor.val_round += 1
        cursor.last_val_version = version
        cursor.val_sum, cursor.val_count, cursor.val_role_sums = 0.0, 0, ""
        chosen = samples[: self.section.val_samples or None]
        groups = [new_group(cursor, s, "val", self.section.val_group_size, version) for s in chosen]
        self.dispatcher.commit(groups, cursor, version)
        report.event(
            self.r,
            self.keys,
            "val_round_dispatched",
            round=cursor.val_round,
            version=version,
            groups=len(groups),
            end=end,
        )
        return cursor, groups

    def close(self, cursor: Cursor, pipe: redis.client.Pipeline) -> None:
        """The round's last group settled: its mean reward becomes a `val` RewardPoint, queued
        on `pipe`, the transaction that records that group's last outcome (and the cursor's
        val_sum/val_count), so the point exists exactly when the round is closed."""
        count = cursor.val_count
        mean = cursor.val_sum / count if count else float("nan")
        point = schemas.RewardPoint(
            run=self.keys.run,
            version=cursor.last_val_version,
            mode="val",
            mean=mean,
            count=count,
            group_id=f"round{cursor.val_round}",
        )
        report.reward(pipe, self.keys, point)
        for role, (total, n) in json.loads(cursor.val_role_sums or "{}").items():
            role_point = schemas.RewardPoint(
                run=self.keys.run,
                version=cursor.last_val_version,
                mode="val",
                mean=total / n if n else float("nan"),
                count=n,
                group_id=f"round{cursor.val_round}",
                role=role,
            )
            report.reward(pipe, self.keys, role_point)

    def closed(self, cursor: Cursor) -> None:
        """After the closing transaction: the event and log line (informational, may be lost)."""
        count = cursor.val_count
        mean = cursor.val_sum / count if count else float("nan")
        version = cursor.last_val_version
        report.event(
            self.r, self.keys, "val_reward", round=cursor.val_round, version=version, mean=mean, count=count
        )
        self.log.info(
            "val_round_done", round=cursor.val_round, version=version, mean_reward=mean, count=count
        )

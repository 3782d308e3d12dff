"""Validation rounds: the validation set dispatched every `val_every` trainer versions.

One round is open at a time; its groups are `val` groups (no training, ledger ok -> validated),
their rewards are summed in the cursor, and when the last one settles the round's mean becomes
one `val` RewardPoint. When the training data runs out a last round on the newest version is
owed (`val_at_end`), so a run ends measured.
"""

from __future__ import annotations

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


def final_val_due(
    *, val_at_end: bool, val_every: int, has_val: bool, last_val_version: int, version: int
) -> bool:
    """A last validation round is owed on `version`, the newest one."""
    return val_at_end and bool(val_every) and has_val and last_val_version < version


def val_round_due(
    *, val_every: int, has_val: bool, round_open: bool, last_val_version: int, version: int, final: bool
) -> bool:
    """Dispatch a validation round at `version` now? (`final`: a last round is owed.)

    The first round goes out at once, then one every `val_every` versions, one at a time.
    """
    if not val_every or not has_val or round_open:
        return False
    if last_val_version < 0 or final:
        return True
    return version >= last_val_version + val_every


def round_open(groups: Iterable[Group]) -> bool:
    return any(g.mode == "val" for g in groups)


class Validation:
    """Starts and closes validation rounds; the owner decides when (see `val_round_due`)."""

    def __init__(
        self, r: redis.Redis, keys: Keys, section: SchedulerSection, dispatcher: Dispatcher, log
    ) -> None:
        self.r, self.keys, self.section, self.dispatcher, self.log = r, keys, section, dispatcher, log

    def start(self, samples: list[Sample], cursor: Cursor, version: int) -> tuple[Cursor, list[Group]]:
        """Dispatch one round on `version`; returns the committed cursor and the round's groups."""
        cursor = cursor.copy()
        cursor.val_round += 1
        cursor.last_val_version = version
        cursor.val_sum, cursor.val_count = 0.0, 0
        chosen = samples[: self.section.val_samples or None]
        groups = [new_group(cursor, s, "val", self.section.val_group_size, version) for s in chosen]
        self.dispatcher.commit(groups, cursor, version)
        report.event(self.r, self.keys, "val_round_dispatched", round=cursor.val_round, version=version,
                     groups=len(groups))  # fmt: skip
        return cursor, groups

    def close(self, cursor: Cursor) -> None:
        """The round's last group settled: its mean reward becomes a `val` RewardPoint."""
        count = cursor.val_count
        mean = cursor.val_sum / count if count else float("nan")
        version = cursor.last_val_version
        point = schemas.RewardPoint(run=self.keys.run, version=version, mode="val", mean=mean, count=count,
                                    group_id=f"round{cursor.val_round}")  # fmt: skip
        report.reward(self.r, self.keys, point)
        report.event(self.r, self.keys, "val_reward", round=cursor.val_round, version=version, mean=mean,
                     count=count)  # fmt: skip
        self.log.info(
            "val_round_done", round=cursor.val_round, version=version, mean_reward=mean, count=count
        )

"""The scheduler's place in the data and its run-wide settings, one hash in Redis."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import redis

from squall.shared.keys import Keys

LEADER_FIELD = "leader_epoch"  # field of Keys.scheduler_state: bumped by each scheduler taking the lead


@dataclass
class Cursor:
    """The scheduler's place in the data, persisted in Keys.scheduler_state."""

    epoch: int = 0  # current training epoch
    position: int = 0  # next row of this epoch's order
    group_seq: int = 0  # counter behind group ids
    samples: int = 0  # training samples dispatched so far
    val_round: int = 0  # validation rounds dispatched so far
    last_val_version: int = -1  # trainer version of the last validation round (-1: none yet)
    val_sum: float = 0.0  # reward sum of the open validation round
    val_count: int = 0  # rewards in that sum
    val_role_sums: str = ""  # [roles] runs: JSON {role: [sum, count]} of the open round's per-role rewards
    control_id: str = "0-0"  # last Control entry applied
    paused: int = 0
    draining: int = 0
    max_inflight_groups: int = 0  # limits as changed by Control (0: the config's)
    max_staleness: int = -1  # (-1: the config's)
    finished: int = 0  # 1 once a scheduler finished the run (a standby then just exits)

    @classmethod
    def load(cls, r: redis.Redis, keys: Keys) -> Cursor:
        raw: dict[bytes, bytes] = r.hgetall(keys.scheduler_state)  # type: ignore[assignment]
        cursor = cls()
        for name, value in raw.items():
            attr = name.decode()
            if hasattr(cursor, attr):
                setattr(cursor, attr, type(getattr(cursor, attr))(value.decode()))
        return cursor

    def copy(self) -> Cursor:
        """A copy to change while building a transaction (self stays as committed)."""
        return dataclasses.replace(self)

    def fields(self) -> dict[str, Any]:
        return {k: str(v) for k, v in self.__dict__.items()}

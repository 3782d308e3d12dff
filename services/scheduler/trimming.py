"""Trimming: the scheduler is the run's janitor.

- `tasks` and `trajectories` lose the entries every consumer group of theirs has acknowledged
  (`bus.trim_acknowledged`: nothing still pending or unread by any group goes);
- the prompt optimiser's group (services/optimizer) holds `trajectories` back too, where it
  exists;
- heartbeats older than `HEARTBEAT_PRUNE_AFTER_S` are removed: a process killed with -9 never
  removes its own, and without this they would stay in the hash forever.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis

from squall.shared import bus, schemas
from squall.shared.heartbeat import STALE_AFTER_S, read_heartbeats
from squall.shared.keys import GROUP_OPTIMIZER, Keys

HEARTBEAT_PRUNE_AFTER_S = 10 * STALE_AFTER_S  # long dead, not just slow: nobody reads it as alive


def _name(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def long_dead(
    beats: Iterable[tuple[str, schemas.Heartbeat | None, str]], now: float, older_than: float
) -> list[str]:
    """Fields of heartbeats older than `older_than` seconds (undecodable ones are left for
    `squall status` to show)."""
    return [name for name, beat, _ in beats if beat is not None and now - beat.time > older_than]


class Trimmer:
    """Trims at most every `every_s` seconds (monotonic clock)."""

    def __init__(
        self, r: redis.Redis, keys: Keys, every_s: float, log, roles: Sequence[str] = ("policy",)
    ) -> None:
        self.r, self.keys, self.every_s, self.log = r, keys, every_s, log
        self.roles = tuple(roles)  # the trained roles: each has its own trainer group on `trajectories`
        self.last = time.monotonic()  # the first trim waits one interval

    def maybe_trim(self) -> bool:
        """Trim if `every_s` passed since the last time; True if it did."""
        now = time.monotonic()
        if now - self.last < self.every_s:
            return False
        self.last = now
        self.trim()
        return True

    def _optional_groups(self, stream: str) -> tuple[str, ...]:
        """The optimiser's group on `trajectories`, where one exists: entries it has not read stay."""
        if stream != self.keys.trajectories:
            return ()
        try:
            names = {_name(info["name"]) for info in self.r.xinfo_groups(stream)}
        except redis.ResponseError:
            return ()
        return (GROUP_OPTIMIZER,) if GROUP_OPTIMIZER in names else ()

    def trim(self) -> dict[str, int]:
        """Trim both work streams and prune dead heartbeats; returns what went, per key."""
        removed = {}
        for stream in (self.keys.tasks, self.keys.trajectories):
            groups = self.keys.groups_of(stream, self.roles) + self._optional_groups(stream)
            removed[stream] = bus.trim_acknowledged(self.r, stream, groups)
        dead = long_dead(read_heartbeats(self.r, self.keys), time.time(), HEARTBEAT_PRUNE_AFTER_S)
        if dead:
            self.r.hdel(self.keys.heartbeats, *dead)
            self.log.info("heartbeats_pruned", fields=dead, older_than_s=HEARTBEAT_PRUNE_AFTER_S)
        removed[self.keys.heartbeats] = len(dead)
        return removed

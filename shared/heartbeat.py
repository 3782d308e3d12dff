"""Heartbeats: each live process's field in the hash `heartbeats`, written by one helper.

A process is alive while its heartbeat is younger than `STALE_AFTER_S`; every reader (the run
snapshot, the scheduler's standby logic, tests) uses that one constant. The field name is
`<service>:<instance>` (`Heartbeat.hash_field`), the value flat JSON (`schemas.encode_heartbeat`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from . import schemas
from .errors import SchemaError
from .keys import Keys

STALE_AFTER_S = 15.0  # a heartbeat older than this marks its process as gone


class HeartbeatWriter:
    """Writes one process's heartbeat at most every `every_s` seconds, and removes it at exit."""

    def __init__(
        self, r: Any, keys: Keys, service: schemas.ServiceName, instance: str, *, every_s: float = 2.0
    ) -> None:
        self.r, self.keys, self.every_s = r, keys, every_s
        self.service, self.instance = service, instance
        self.field = f"{service}:{instance}"
        self.last = 0.0  # wall-clock time of the last write (0: never)

    def build(self, *, version: int = -1, metrics_port: int = 0, **stats: float) -> schemas.Heartbeat:
        return schemas.Heartbeat(
            run=self.keys.run, service=self.service, instance=self.instance, pid=os.getpid(),
            version=version, metrics_port=metrics_port, stats={k: float(v) for k, v in stats.items()},
        )  # fmt: skip

    def due(self) -> bool:
        return time.time() - self.last >= self.every_s

    def beat(self, *, force: bool = False, version: int = -1, metrics_port: int = 0, **stats: float) -> bool:
        """Write the heartbeat if `every_s` passed since the last one (or `force`); True if written."""
        if not force and not self.due():
            return False
        beat = self.build(version=version, metrics_port=metrics_port, **stats)
        self.r.hset(self.keys.heartbeats, self.field, schemas.encode_heartbeat(beat))
        self.last = beat.time
        return True

    async def beat_async(self, *, version: int = -1, metrics_port: int = 0, **stats: float) -> None:
        """The same write on an asyncio Redis client (`redis.asyncio`), unconditionally."""
        beat = self.build(version=version, metrics_port=metrics_port, **stats)
        await self.r.hset(self.keys.heartbeats, self.field, schemas.encode_heartbeat(beat))
        self.last = beat.time

    def remove(self) -> None:
        """A clean exit: the process is gone, not dead."""
        self.r.hdel(self.keys.heartbeats, self.field)


def read_heartbeats(r: redis.Redis, keys: Keys) -> list[tuple[str, schemas.Heartbeat | None, str]]:
    """Every heartbeat as (field, decoded or None, error text); sorted by field."""
    rows: list[tuple[str, schemas.Heartbeat | None, str]] = []
    raw: dict[bytes, bytes] = r.hgetall(keys.heartbeats)  # type: ignore[assignment]
    for field, value in raw.items():
        name = field.decode()
        try:
            rows.append((name, schemas.decode_heartbeat(name, value, keys.run), ""))
        except SchemaError as exc:
            rows.append((name, None, str(exc)))
    return sorted(rows, key=lambda row: row[0])


def is_alive(beat: schemas.Heartbeat | None, now: float | None = None) -> bool:
    return beat is not None and (now if now is not None else time.time()) - beat.time < STALE_AFTER_S

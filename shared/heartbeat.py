"""Heartbeats: each live process's field in the hash `heartbeats`, written by one helper.

A process is alive while its heartbeat is younger than `STALE_AFTER_S` and not marked stopped;
every reader (the run snapshot, the scheduler's standby logic, tests) goes through `is_alive`
and `state_of`. A process that exits cleanly writes a last heartbeat with `stopped` set (its
last version and counts kept), so views show it as *stopped* rather than alive until the
heartbeat ages out, or as *gone* when it died without one. The field name is
`<service>:<instance>` (`Heartbeat.hash_field`), the value flat JSON (`schemas.encode_heartbeat`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import redis

from . import schemas
from .errors import SchemaError
from .keys import Keys

STALE_AFTER_S = 15.0  # a heartbeat older than this marks its process as gone


class HeartbeatWriter:
    """Writes one process's heartbeat at most every `every_s` seconds, and marks it stopped at exit."""

    def __init__(
        self, r: Any, keys: Keys, service: schemas.ServiceName, instance: str, *, every_s: float = 2.0
    ) -> None:
        self.r, self.keys, self.every_s = r, keys, every_s
        self.service, self.instance = service, instance
        self.field = f"{service}:{instance}"
        self.last = 0.0  # wall-clock time of the last write (0: never)
        self.said: dict[str, Any] = {}  # the last beat's version, port and stats, repeated by `stop`

    def build(self, *, version: int = -1, metrics_port: int = 0, **stats: float) -> schemas.Heartbeat:
        self.said = {"version": version, "metrics_port": metrics_port, **stats}
        return schemas.Heartbeat(
            run=self.keys.run,
            service=self.service,
            instance=self.instance,
            pid=os.getpid(),
            version=version,
            metrics_port=metrics_port,
            stats={k: float(v) for k, v in stats.items()},
        )

    def _stopped_beat(self, stats: dict[str, float]) -> bytes:
        said = {**self.said, **stats}
        beat = self.build(**said)
        return schemas.encode_heartbeat(msgspec.structs.replace(beat, stopped=beat.time))

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

    def stop(self, **stats: float) -> None:
        """A clean exit: the last heartbeat, marked stopped (the last beat's fields, updated by
        `stats`), so views show the process as stopped, not alive and not dead."""
        self.r.hset(self.keys.heartbeats, self.field, self._stopped_beat(stats))

    async def stop_async(self, **stats: float) -> None:
        """`stop` on an asyncio Redis client."""
        await self.r.hset(self.keys.heartbeats, self.field, self._stopped_beat(stats))


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
    """Beating: not stopped, and younger than STALE_AFTER_S."""
    return state_of(beat, now) == "alive"


def state_of(beat: schemas.Heartbeat | None, now: float | None = None) -> str:
    """`alive`, `stopped` (exited cleanly) or `gone` (stale, or undecodable: it died)."""
    if beat is None:
        return "gone"
    if beat.stopped:
        return "stopped"
    return "alive" if (now if now is not None else time.time()) - beat.time < STALE_AFTER_S else "gone"

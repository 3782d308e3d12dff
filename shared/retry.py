"""Riding through a Redis outage: one policy for every service.

A Redis restart (or a failover, or a network blip) surfaces as `redis.ConnectionError` /
`redis.TimeoutError` (a server still loading its AOF answers `BusyLoadingError`, a
ConnectionError too). A service's loop catches them around one unit of work and calls
`RedisOutage.wait`, which pings with capped exponential backoff until Redis answers, logging
and counting each outage; past `deadline_s` it raises RedisUnavailable naming the URL, and the
service exits non-zero. After `wait` returns the caller re-reads its state from Redis (each
unit of work is one transaction or idempotent, so a half-sent one is harmless).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from .errors import RedisUnavailable
from .redisconn import redact

REDIS_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
FIRST_PAUSE_S = 0.1
MAX_PAUSE_S = 5.0


@dataclass
class RedisOutage:
    """Waits for Redis to come back, within a deadline; counts outages and retries."""

    url: str  # for the log and the final error (password redacted)
    deadline_s: float = 120.0  # longest ride-through of one outage
    log: Any = None  # a structlog logger (None: silent)
    on_outage: Callable[[], None] | None = None  # e.g. a Prometheus counter's inc
    outages: int = 0  # outages ridden through so far
    retries: int = 0  # pings that found Redis still down
    started: float = field(default=0.0, repr=False)

    def _begin(self, error: BaseException, where: str) -> float:
        self.outages += 1
        if self.on_outage is not None:
            self.on_outage()
        if self.log is not None:
            self.log.warning(
                "redis_outage",
                where=where,
                error=str(error),
                url=redact(self.url),
                deadline_s=self.deadline_s,
                outages=self.outages,
            )
        self.started = time.monotonic()
        return self.started + self.deadline_s

    def _give_up(self, error: BaseException | None) -> RedisUnavailable:
        return RedisUnavailable(
            f"Redis at {redact(self.url)} did not come back within {self.deadline_s:.0f}s "
            f"(last error: {error}); start it again (or raise run.redis_outage_s) and restart this service"
        )

    def _back(self, where: str) -> None:
        if self.log is not None:
            self.log.info(
                "redis_back",
                where=where,
                down_s=round(time.monotonic() - self.started, 3),
                retries=self.retries,
                outages=self.outages,
            )

    def _ping_failed(self, end: float, pause: float, last: BaseException | None) -> float:
        """Count a ping that found Redis down; the next pause, or RedisUnavailable past `end`."""
        self.retries += 1
        if time.monotonic() >= end:
            raise self._give_up(last)
        return min(pause, max(0.0, end - time.monotonic()))

    def wait(self, r: redis.Redis, error: BaseException, where: str = "") -> None:
        """Block until `r` answers PING; raise RedisUnavailable past the deadline."""
        end, pause, last = self._begin(error, where), FIRST_PAUSE_S, error
        while True:
            try:
                if r.ping():
                    return self._back(where)
            except REDIS_ERRORS as exc:
                last = exc
            time.sleep(self._ping_failed(end, pause, last))
            pause = min(pause * 2, MAX_PAUSE_S)

    async def wait_async(self, r: Any, error: BaseException, where: str = "") -> None:
        """`wait` for a `redis.asyncio` client."""
        end, pause, last = self._begin(error, where), FIRST_PAUSE_S, error
        while True:
            try:
                if await r.ping():
                    return self._back(where)
            except REDIS_ERRORS as exc:
                last = exc
            await asyncio.sleep(self._ping_failed(end, pause, last))
            pause = min(pause * 2, MAX_PAUSE_S)

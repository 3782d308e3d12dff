"""Connecting to Redis from a URL (user, password, TLS via rediss://), with a deadline,
and starting a local server when none answers at a local URL and the caller allows it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import redis

from .errors import RedisUnavailable
from .localredis import LocalRedis

CONNECT_DEADLINE_S = 5.0  # how long to wait for a configured Redis before giving up
SOCKET_TIMEOUT_S = 30.0  # must exceed the longest blocking read (XREADGROUP BLOCK)
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}

_started: list[LocalRedis] = []


@contextlib.contextmanager
def owned_servers() -> Iterator[None]:
    """Local servers `connect(..., autostart=True)` starts inside the block are stopped when it
    ends (a caller in a long-lived process, e.g. `squall.up()`, must not leave them running)."""
    before = len(_started)
    try:
        yield
    finally:
        for server in _started[before:]:
            server.close()
        del _started[before:]


def redact(url: str) -> str:
    """The URL with its password replaced, for logs and errors."""
    parsed = urlparse(url)
    if parsed.password:
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
        return parsed._replace(netloc=netloc).geturl()
    return url


def client_for(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=2.0, health_check_interval=30
    )


def ping_until(client: redis.Redis, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while True:
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)


def connect(
    url: str, *, autostart: bool = False, deadline_s: float = CONNECT_DEADLINE_S, data_dir: str | None = None
) -> redis.Redis:
    """A client for `url` that answered PING.

    With `autostart`, a local URL with nobody listening gets a server of our own on that port
    (a child process, gone when we exit); anything else raises RedisUnavailable.
    """
    client = client_for(url)
    if ping_until(client, 0.5 if autostart else deadline_s):
        return client
    parsed = urlparse(url)
    if autostart and parsed.hostname in LOCAL_HOSTS and parsed.scheme == "redis" and not parsed.password:
        server = LocalRedis(port=parsed.port or 6379, data_dir=data_dir, aof=data_dir is not None).start()
        _started.append(server)
        if ping_until(client, deadline_s):
            return client
    raise RedisUnavailable(
        f"no Redis answers at {redact(url)} within {deadline_s}s: start one with `squall redis` "
        "or set SQUALL_RUN__REDIS_URL"
    )

"""Durability of Redis against a host crash, not just a process crash.

A process crash (Redis killed, restarted) loses nothing that Redis wrote to its AOF, since
the kernel's page cache still holds it. A host crash (power, a preempted VM) loses whatever
was not fsynced: with `appendfsync everysec`, up to about a second of writes; with
`appendonly no`, everything since the last snapshot. `check` reads the server's settings at a
service's start and says what is missing (warn or refuse, `run.redis_durability`); `waitaof`
makes the few writes that must not be lost once acted on wait for their fsync (WAITAOF,
Redis 7.2+); `LostWrites` is what the trainer finds when Redis came back older than its own
durable checkpoint says it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from .errors import ConfigError

DURABLE_FSYNC = ("everysec", "always")


@dataclass
class Settings:
    """What the server said (None: it would not say, e.g. an ACL user without CONFIG)."""

    appendonly: str | None
    appendfsync: str | None
    waitaof: bool | None  # the server knows WAITAOF (7.2+)
    error: str = ""  # why a setting could not be read

    def problems(self, *, want_waitaof: bool) -> list[str]:
        out = []
        if self.appendonly is None or self.appendfsync is None:
            out.append(f"could not read appendonly/appendfsync ({self.error}); check them by hand")
        elif self.appendonly != "yes":
            out.append("appendonly is 'no': a Redis restart loses everything since the last snapshot")
        elif self.appendfsync not in DURABLE_FSYNC:
            out.append(f"appendfsync is {self.appendfsync!r}: a host crash loses writes nobody fsynced")
        if want_waitaof and self.waitaof is False:
            out.append("run.redis_waitaof is set but this Redis has no WAITAOF (needs 7.2 or newer)")
        return out


def read_settings(r: redis.Redis) -> Settings:
    try:
        config: Any = r.config_get("append*")
        appendonly, appendfsync, error = config.get("appendonly"), config.get("appendfsync"), ""
    except redis.ResponseError as exc:  # NOPERM for a service's ACL user
        appendonly, appendfsync, error = None, None, str(exc).splitlines()[0][:200]
    try:  # COMMAND LIST (7.0+); redis-py's callback for a bare "COMMAND" cannot parse its reply
        waitaof: bool | None = "waitaof" in {
            _text(name).lower() for name in r.command_list(pattern="waitaof")
        }
    except redis.ResponseError:  # before 7.0, or an ACL user without COMMAND
        waitaof = None
    return Settings(appendonly, appendfsync, waitaof, error)


def check(r: redis.Redis, mode: str, log: Any, *, service: str, want_waitaof: bool = False) -> list[str]:
    """The durability problems of the server (logged as `redis_not_durable`); ConfigError in
    mode refuse when there is any. Mode off: nothing is read."""
    if mode == "off":
        return []
    problems = read_settings(r).problems(want_waitaof=want_waitaof)
    if not problems:
        return []
    advice = (
        "set `appendonly yes` and `appendfsync everysec` (or always) in redis.conf, "
        'or run.redis_durability = "warn" to start anyway (docs/operating.md, Durability)'
    )
    if mode == "refuse":
        raise ConfigError(
            f"{service}: Redis is not durable enough for run.redis_durability=refuse: "
            f"{'; '.join(problems)}; {advice}"
        )
    log.warning("redis_not_durable", service=service, problems=problems, advice=advice)
    return problems


def waitaof(r: redis.Redis, timeout_ms: int, log: Any, where: str) -> bool:
    """Wait until this connection's writes are fsynced to the local AOF; False (logged) when
    the server did not confirm within `timeout_ms`, or has no AOF to wait for (appendonly
    turned off: the start check warned). Call on the client that wrote them."""
    try:
        local, _replicas = r.execute_command("WAITAOF", 1, 0, timeout_ms)
    except redis.ResponseError as exc:
        if "appendonly is disabled" not in str(exc):
            raise
        log.warning("redis_waitaof_no_aof", where=where, error=str(exc)[:200])
        return False
    if int(local) < 1:
        log.warning("redis_waitaof_late", where=where, timeout_ms=timeout_ms)
        return False
    return True


@dataclass
class LostWrites:
    """Redis's record of the trainer's commits against the trainer's own durable one."""

    redis_commit: int  # the last commit whose ledger moves and acks Redis holds (0: none)
    checkpoint_commit: int  # the last commit the checkpoint on disk holds

    @property
    def lost(self) -> bool:
        """A checkpoint's settle may be missing (a crash between the two), never two: more
        means Redis came back without writes it had accepted (an AOF tail lost to a host crash)."""
        return self.redis_commit < self.checkpoint_commit - 1


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

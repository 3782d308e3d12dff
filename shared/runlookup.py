"""Finding the Redis a run lives in, for the commands that read one (`squall status`, `peek`).

A run exists in a Redis when one of its keys does (EXISTS over the run's fixed keys, a command
the read-only `monitor` ACL user holds). The URL to look in is `run.redis_url`: from
`--redis-url`, the config file or SQUALL_RUN__REDIS_URL (given: only that Redis is searched),
else the default. With the default, the local Redis servers squall started on this machine and
that still run (shared.localredis records them: `squall up` starts one on its config's own port)
are searched as well, and the run is read from the one that holds it. Nothing found is a
RunNotFound naming the run, each Redis looked in and the runs it holds, and what to pass.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import redis

from .config import RunConfig
from .errors import RunNotFound
from .keys import PREFIX, Keys
from .localredis import recorded_servers
from .redisconn import CONNECT_DEADLINE_S, client_for, ping_until, redact

DEFAULT_URL_DEADLINE_S = 1.0  # a default URL nobody answers at is one place among others to look
LIST_RUNS_MAX_KEYS = 200_000  # keys scanned to list a Redis's runs before giving up on the list


@dataclass(frozen=True)
class Place:
    """One Redis a run was looked for in."""

    url: str
    why: str  # where the URL came from, for people
    deadline_s: float


@dataclass(frozen=True)
class Found:
    client: redis.Redis
    url: str
    note: str  # "" when the run was where the command was pointed; else where it was found


def run_keys(keys: Keys) -> list[str]:
    """The run's fixed keys: every stream and hash some service writes."""
    hashes = (
        keys.config,
        keys.ledger,
        keys.attempts,
        keys.scheduler_state,
        keys.groups,
        keys.heartbeats,
        keys.versions,
        keys.warnings,
    )
    return [*keys.stream_names().values(), *hashes]


def has_run(r: redis.Redis, keys: Keys) -> bool:
    return int(r.exists(*run_keys(keys))) > 0  # type: ignore[arg-type]


def runs_in(r: redis.Redis) -> list[str] | None:
    """Names of the runs with keys in this Redis; None when it cannot be told (SCAN refused by
    an ACL, or more keys than LIST_RUNS_MAX_KEYS)."""
    runs: set[str] = set()
    try:
        for scanned, key in enumerate(r.scan_iter(match=f"{PREFIX}:*", count=1000)):
            if scanned >= LIST_RUNS_MAX_KEYS:
                return None
            name = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            runs.add(name.split(":")[1])
    except redis.ResponseError:  # NOPERM: a least-privilege user may not list keys
        return None
    return sorted(runs)


def places(url: str, url_given: str) -> list[Place]:
    """Where to look: the URL given (`url_given` says by what; "" for the default), else the
    default and every local server squall started that still runs."""
    if url_given:
        return [Place(url, url_given, CONNECT_DEADLINE_S)]
    found = [Place(url, "the default run.redis_url", DEFAULT_URL_DEADLINE_S)]
    for server in recorded_servers():
        if server.url != url:
            why = f"a local Redis squall started: pid {server.pid}, by `{server.owner}`"
            found.append(Place(server.url, why, DEFAULT_URL_DEADLINE_S))
    return found


def find_run(run: str, url: str, url_given: str) -> Found:
    """A client of the Redis that holds `run`, or RunNotFound saying where it looked."""
    keys = Keys(run)
    looked = []
    for place in places(url, url_given):
        client = client_for(place.url)
        try:
            if not ping_until(client, place.deadline_s):
                looked.append(f"{redact(place.url)} ({place.why}): no Redis answers there")
                continue
            if has_run(client, keys):
                note = "" if place.url == url else f"run {run!r} found in {redact(place.url)}, {place.why}"
                return Found(client, place.url, note)
            runs = runs_in(client)
        except redis.RedisError as exc:
            looked.append(f"{redact(place.url)} ({place.why}): {type(exc).__name__}: {exc}")
            continue
        held = "cannot be listed with this user" if runs is None else (", ".join(runs) or "none")
        looked.append(f"{redact(place.url)} ({place.why}): runs there: {held}")
        client.close()
    raise RunNotFound(_not_found(run, looked, bool(url_given)))


def _not_found(run: str, looked: list[str], url_given: bool) -> str:
    where = "\n".join(f"  {line}" for line in looked)
    hint = (
        "Check the run name (--run), or point the command at the run's Redis with --redis-url URL."
        if url_given
        else "Point the command at the run's Redis: --config RUN_FILE (its run.redis_url) or --redis-url URL."
        " A Redis that `squall up` started itself lives only as long as that `squall up`."
    )
    return f"run {run!r} not found: no key {PREFIX}:{run}:* in\n{where}\n{hint}"


def find_run_for(args: object, config: RunConfig, command: str) -> redis.Redis | None:
    """The client of the run's Redis, for `squall <command>` and its parsed options (--run,
    --config, --redis-url); where it was found, if not where pointed, is said on stderr. None
    when there is no such run, with the RunNotFound message printed (the command exits 2)."""
    try:
        found = find_run(config.run.name, config.run.redis_url, url_origin(args, config.run.model_fields_set))
    except RunNotFound as exc:
        print(f"squall {command}: {exc}", file=sys.stderr)
        return None
    if found.note:
        print(f"squall {command}: {found.note}", file=sys.stderr)
    return found.client


def url_origin(args: object, fields_set: set[str]) -> str:
    """What gave run.redis_url, for the messages ("" when it is the default)."""
    if getattr(args, "redis_url", None):
        return "--redis-url"
    if "redis_url" in fields_set:
        config = getattr(args, "config", None)
        return f"run.redis_url of {config} or SQUALL_RUN__REDIS_URL" if config else "SQUALL_RUN__REDIS_URL"
    return ""

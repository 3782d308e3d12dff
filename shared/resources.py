"""Versioned resources: named text artifacts an agent reads (a system prompt, a template, a
few-shot block), published and pinned like weights.

Redis (every name in shared/keys.py):
- stream `resources`          one `ResourceVersion` per version published (current or candidate),
                              for people (`squall peek resources`) and followers;
- hash `resources:versions`   `name@version` -> the encoded ResourceVersion, so a runner fetches
                              exactly the version its task pinned (versions never change);
- hash `resources:current`    `name` -> JSON {version, generation}: what new tasks pin.

Versions of a name count from 1, candidates included (an APO candidate is a version that was
never current). `generation` counts promotions to current: the scheduler's staleness check
measures how many promotions an in-flight group is behind in it, so evaluated-then-dropped
candidates never make a group stale. Publishing is one optimistic transaction (WATCH/MULTI),
so two publishers never hand out one version twice.

Content travels inline up to `MAX_INLINE_BYTES`; a bigger artifact goes in a file whose path is
the `location` (checksummed, read by the runner at hand-out). Anything over `MAX_BYTES` is
refused with an error saying so.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import redis

from . import schemas
from .errors import ConfigError
from .keys import Keys

MAX_INLINE_BYTES = 64 * 1024  # above this, publish a file and its location
MAX_BYTES = 1024 * 1024  # no resource (inline or file) may be larger
NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
FILE_PREFIX = "file:"  # a run file's `[resources] x = "file:path"` reads the text from that path


class ResourceError(ConfigError):
    """A resource that cannot be published or handed out (too large, bad name, missing)."""


def checksum(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_name(name: str) -> None:
    if not NAME_PATTERN.match(name):
        raise ResourceError(
            f"resource name {name!r} is not valid: use 1-64 letters, digits or '_', starting with a letter "
            "(it becomes an environment variable AGENT_RESOURCE_<NAME> for command agents)"
        )


def check_size(name: str, size: int, *, inline: bool) -> None:
    limit = MAX_INLINE_BYTES if inline else MAX_BYTES
    if size > limit:
        hint = (
            "write it to a file and publish its location (resources.publish(..., location=PATH))"
            if inline and size <= MAX_BYTES
            else f"resources are at most {MAX_BYTES} bytes"
        )
        raise ResourceError(f"resource {name!r} is {size} bytes, over the limit of {limit}: {hint}")


def _current(r: redis.Redis, keys: Keys, name: str) -> dict[str, int]:
    raw = r.hget(keys.resources_current, name)
    return json.loads(raw) if raw else {"version": 0, "generation": 0}


def publish(
    r: redis.Redis,
    keys: Keys,
    name: str,
    content: str = "",
    *,
    location: str = "",
    current: bool = True,
    source: str = "",
    note: str = "",
) -> schemas.ResourceVersion:
    """Publish a new version of `name` (inline `content`, or a file at `location`); make it what
    new tasks pin when `current`. Returns the ResourceVersion as stored."""
    check_name(name)
    if location:
        text = read_location(name, location)
        digest, size, content = checksum(text), len(text.encode()), ""
        check_size(name, size, inline=False)
    else:
        size = len(content.encode())
        check_size(name, size, inline=True)
        digest = checksum(content)
    seq_field = f"{name}:seq"
    while True:
        with r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(keys.resources_current)
                now = _current(pipe, keys, name)  # type: ignore[arg-type]
                last = int(pipe.hget(keys.resources_current, seq_field) or 0)
                version = max(last, now["version"]) + 1
                generation = now["generation"] + 1 if current else -1
                message = schemas.ResourceVersion(
                    run=keys.run,
                    name=name,
                    version=version,
                    generation=generation,
                    checksum=digest,
                    size=size,
                    content=content,
                    location=location,
                    current=current,
                    source=source,
                    note=note,
                )
                encoded = schemas.encode(message)
                pipe.multi()
                pipe.hset(keys.resources_current, seq_field, version)
                if current:
                    pipe.hset(
                        keys.resources_current,
                        name,
                        json.dumps({"version": version, "generation": generation}),
                    )
                pipe.hset(keys.resources_versions, f"{name}@{version}", encoded)
                pipe.xadd(keys.resources, {schemas.ENTRY_FIELD: encoded}, maxlen=10_000, approximate=True)
                pipe.execute()
                return message
            except redis.WatchError:
                continue


def promote(
    r: redis.Redis, keys: Keys, name: str, version: int, *, source: str = ""
) -> schemas.ResourceVersion:
    """Make an existing (candidate) version current again under a new version number, so the
    stream shows the promotion and versions only grow."""
    found = get(r, keys, name, version)
    return publish(
        r, keys, name, found.content, location=found.location, source=source, note=f"promoted from v{version}"
    )


def publish_initial(r: redis.Redis, keys: Keys, resources: dict[str, str], *, source: str) -> list[str]:
    """The run file's `[resources]`: publish each one that has no version yet (a restart, or a
    second service doing the same, publishes nothing). Returns the names published."""
    published = []
    for name, value in resources.items():
        check_name(name)
        if r.hexists(keys.resources_current, name):
            continue
        if value.startswith(FILE_PREFIX):
            text = read_location(name, value[len(FILE_PREFIX) :])
            check_size(name, len(text.encode()), inline=False)
            if len(text.encode()) > MAX_INLINE_BYTES:
                publish(r, keys, name, location=value[len(FILE_PREFIX) :], source=source)
            else:
                publish(r, keys, name, text, source=source)
        else:
            publish(r, keys, name, value, source=source)
        published.append(name)
    return published


def current_pins(r: redis.Redis, keys: Keys) -> dict[str, tuple[int, int]]:
    """name -> (version, generation) of every current resource."""
    raw: dict[bytes, bytes] = r.hgetall(keys.resources_current)  # type: ignore[assignment]
    out = {}
    for field, value in raw.items():
        name = field.decode()
        if ":" in name:
            continue  # the `<name>:seq` counters
        body = json.loads(value)
        out[name] = (int(body["version"]), int(body["generation"]))
    return out


def get(r: redis.Redis, keys: Keys, name: str, version: int) -> schemas.ResourceVersion:
    raw: bytes | None = r.hget(keys.resources_versions, f"{name}@{version}")  # type: ignore[assignment]
    if raw is None:
        raise ResourceError(f"resource {name!r} has no version {version} in {keys.resources_versions}")
    return schemas.decode(raw, schemas.ResourceVersion)


def read_location(name: str, location: str) -> str:
    path = Path(location)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ResourceError(f"resource {name!r}: cannot read {location}: {exc.strerror}") from None
    check_size(name, size, inline=False)
    return path.read_text()


def text_of(version: schemas.ResourceVersion) -> str:
    """The version's text: inline, or read from its location and checked against its checksum."""
    if not version.location:
        return version.content
    text = read_location(version.name, version.location)
    if checksum(text) != version.checksum:
        raise ResourceError(
            f"resource {version.name!r} v{version.version}: {version.location} changed since it was "
            "published (checksum differs); publish a new version instead of editing the file"
        )
    return text


class ResourceCache:
    """A runner's copy of the versions it handed out: versions never change, so each is read
    from Redis once."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.texts: dict[tuple[str, int], str] = {}

    def texts_for(self, pins: dict[str, int]) -> dict[str, str]:
        missing = [(n, v) for n, v in pins.items() if (n, v) not in self.texts]
        for name, version in missing:
            self.texts[(name, version)] = text_of(get(self.r, self.keys, name, version))
        return {name: self.texts[(name, version)] for name, version in pins.items()}


def describe(version: schemas.ResourceVersion) -> dict[str, Any]:
    """One line of `squall peek resources`-like output without the (possibly long) content."""
    return {
        "name": version.name,
        "version": version.version,
        "current": version.current,
        "checksum": version.checksum[:12],
        "size": version.size,
    }

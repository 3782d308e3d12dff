"""One snapshot of a live run, read from Redis: what the dashboard and /metrics show.

Parts (each a function of (redis, Keys), read-only, usable with the `squall-monitor` ACL user):
- stream_lengths, group_rows: every stream's length; each consumer group's lag and pending;
- ledger_summary: shared.ledger counts, in-flight attempts and conservation;
- heartbeats: every `service:id` in Keys.heartbeats with its age, alive when fresh;
- weight_versions: Keys.versions (`trainer`, `inference:<node>`) and each node's staleness;
- reward_curves: Keys.rewards entries as the scheduler writes them (fields `version`,
  `mode` = train|val, `mean`, `count`, `time`, `group_id`), any field may be missing or junk;
- metric_series: Keys.metrics (Metrics messages) as one (step, value) series per name;
- recent deadletters and events.
A malformed entry is skipped and counted in `skipped`, never an error: the page must keep
showing the rest of the run.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import redis
from squall.shared import schemas
from squall.shared.keys import Keys

HEARTBEAT_STALE_S = 15.0  # a heartbeat older than this marks its process as dead
CURVE_POINTS = 2000  # newest entries of `rewards` and `metrics` read per snapshot
RECENT = 8  # dead letters and events listed


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _number(value: Any) -> float | None:
    """A finite float, or None for anything else (JSON has no NaN)."""
    try:
        number = float(_text(value))
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def stream_lengths(r: redis.Redis, keys: Keys) -> dict[str, int]:
    names = keys.stream_names()
    pipe = r.pipeline(transaction=False)
    for key in names.values():
        pipe.xlen(key)
    return {name: int(n) for name, n in zip(names, pipe.execute(), strict=True)}


def group_rows(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Each consumer group of `tasks` and `trajectories`: lag (undelivered), pending (unacked)."""
    rows = []
    for name, key in (("tasks", keys.tasks), ("trajectories", keys.trajectories)):
        try:
            infos = r.xinfo_groups(key)
        except redis.ResponseError:  # no such stream yet
            infos = []
        for info in infos:
            lag = info.get("lag")
            rows.append({
                "stream": name,
                "group": _text(info["name"]),
                "lag": int(lag) if lag is not None else None,  # None: Redis cannot tell (after XDEL)
                "pending": int(info["pending"]),
                "consumers": int(info["consumers"]),
                "last_delivered": _text(info.get("last-delivered-id", "")),
            })  # fmt: skip
    return rows


def ledger_summary(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    raw = r.hgetall(keys.ledger)
    counts = {_text(k): int(v) for k, v in raw.items() if int(v)}
    dispatched = counts.pop("dispatched", 0)
    total = sum(counts.values())
    return {
        "counts": dict(sorted(counts.items())),
        "dispatched": dispatched,
        "accounted": total,
        "balanced": total == dispatched,
        "in_flight": counts.get("pending", 0) + counts.get("running", 0),
    }


def heartbeats(r: redis.Redis, keys: Keys, now: float) -> list[dict[str, Any]]:
    """Every heartbeat as {id, service, age_s, alive, ...its JSON fields}."""
    rows = []
    for field, raw in r.hgetall(keys.heartbeats).items():
        name = _text(field)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            body = {"error": "heartbeat is not a JSON object"}
        beat = _number(body.get("time"))
        age = now - beat if beat is not None else None
        extra = {k: v for k, v in body.items() if k != "time" and isinstance(v, (str, int, float, bool))}
        rows.append({
            "id": name,
            "service": name.split(":", 1)[0],
            "age_s": round(age, 1) if age is not None else None,
            "alive": age is not None and age < HEARTBEAT_STALE_S,
            "fields": extra,
        })  # fmt: skip
    return sorted(rows, key=lambda row: (row["service"], row["id"]))


def weight_versions(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    raw = {_text(k): _text(v) for k, v in r.hgetall(keys.versions).items()}
    trainer = _number(raw.pop("trainer", None))
    nodes = []
    for field, value in sorted(raw.items()):
        version = _number(value)
        node = field.split(":", 1)[1] if field.startswith("inference:") else field
        behind = trainer - version if trainer is not None and version is not None else None
        nodes.append({"node": node, "version": version, "behind": behind})
    behinds = [n["behind"] for n in nodes if n["behind"] is not None]
    return {"trainer": trainer, "nodes": nodes, "max_behind": max(behinds) if behinds else None}


def reward_curves(r: redis.Redis, keys: Keys, skipped: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """Per mode (train, val): points {version, mean, count, time} in stream order."""
    curves: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    for _, fields in reversed(r.xrevrange(keys.rewards, count=CURVE_POINTS)):
        row = {_text(k): v for k, v in fields.items()}
        mode = _text(row.get("mode", "train"))
        mean, version = _number(row.get("mean")), _number(row.get("version"))
        if mode not in curves or mean is None or version is None:
            skipped["rewards"] = skipped.get("rewards", 0) + 1
            continue
        count = _number(row.get("count"))
        curves[mode].append(
            {"version": version, "mean": mean, "count": count, "time": _number(row.get("time"))}
        )
    return curves


def metric_series(r: redis.Redis, keys: Keys, skipped: dict[str, int]) -> dict[str, Any]:
    """Metrics messages as {name: [[step, value], ...]} plus the newest step's values."""
    series: dict[str, list[list[float]]] = {}
    last: dict[str, Any] = {}
    for _, fields in reversed(r.xrevrange(keys.metrics, count=CURVE_POINTS)):
        try:
            message = schemas.decode(fields.get(schemas.ENTRY_FIELD, b""), schemas.Metrics)
        except Exception:  # SchemaError or anything a foreign writer put there
            skipped["metrics"] = skipped.get("metrics", 0) + 1
            continue
        for name, value in message.values.items():
            number = _number(value)
            if number is not None:
                series.setdefault(name, []).append([message.step, number])
        last = {"step": message.step, "version": message.version, "time": message.time}
    return {"series": dict(sorted(series.items())), "last": last}


def recent_deadletters(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    rows = []
    for entry_id, fields in r.xrevrange(keys.deadletter, count=RECENT):
        row = {_text(k): v for k, v in fields.items() if k != b"raw"}
        rows.append({"entry": _text(entry_id), **{k: _text(v)[:300] for k, v in row.items()}})
    return rows


def recent_events(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    rows = []
    for _, fields in r.xrevrange(keys.events, count=RECENT):
        try:
            event = schemas.decode(fields.get(schemas.ENTRY_FIELD, b""), schemas.Event)
        except Exception:
            continue
        rows.append({"time": event.time, "service": event.service, "name": event.name,
                     "fields": json.loads(json.dumps(event.fields, default=str))})  # fmt: skip
    return rows


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Everything the dashboard shows, as JSON-ready data."""
    now = time.time()
    skipped: dict[str, int] = {}
    versions = weight_versions(r, keys)
    return {
        "run": keys.run,
        "time": now,
        "streams": stream_lengths(r, keys),
        "groups": group_rows(r, keys),
        "ledger": ledger_summary(r, keys),
        "heartbeats": heartbeats(r, keys, now),
        "versions": versions,
        "rewards": reward_curves(r, keys, skipped),
        "metrics": metric_series(r, keys, skipped),
        "deadletters": recent_deadletters(r, keys),
        "events": recent_events(r, keys),
        "skipped": skipped,
    }

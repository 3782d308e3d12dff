"""A run snapshot as JSON: `shared.runstate.read_snapshot` rendered once, in one shape, for
every view of a run — `squall status --json` (status.py), the dashboard's /api/state
(dashboard.py) and `squall up`'s progress line and summary (local/progress.py). Each view adds
only what is its own (the tool pool's summary, the newest rewards, the latest step).

`render` reads nothing; `snapshot` reads and renders (see shared/runstate.py for what is read,
and how malformed entries are skipped and counted). Numbers that are not finite never reach
the output (JSON has no NaN).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import redis

from squall.shared import runstate
from squall.shared.keys import Keys


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _groups(snap: runstate.RunSnapshot) -> list[dict[str, Any]]:
    return [
        {
            "stream": g.stream,
            "group": g.group,
            "lag": g.lag,
            "pending": g.pending,
            "consumers": g.consumers,
            "last_delivered": g.last_delivered,
        }
        for g in snap.groups
    ]


def _ledger(ledger: runstate.LedgerState) -> dict[str, Any]:
    return {
        "counts": ledger.counts,
        "dispatched": ledger.dispatched,
        "accounted": ledger.accounted,
        "balanced": ledger.balanced,
        "in_flight": ledger.in_flight,
    }


def _heartbeats(snap: runstate.RunSnapshot) -> list[dict[str, Any]]:
    return [
        {
            "id": p.id,
            "service": p.service,
            "age_s": round(p.age_s, 1) if p.age_s is not None else None,
            "alive": p.alive,
            "state": p.state,
            "fields": p.fields(),
        }
        for p in snap.processes
    ]


def _versions(versions: runstate.VersionsState) -> dict[str, Any]:
    nodes = [
        {"node": n.node, "version": n.version, "behind": n.behind, "role": n.role} for n in versions.nodes
    ]
    return {
        "trainer": versions.trainer,
        "roles": versions.roles,
        "nodes": nodes,
        "max_behind": versions.max_behind,
        "raw": versions.raw,
    }


def reward_points(points: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "version": p.version,
            "mode": p.mode,
            "mean": p.mean,
            "count": p.count,
            "group_id": p.group_id,
            "time": _finite(p.time),
        }
        for p in points
    ]


def _roles(snap: runstate.RunSnapshot) -> dict[str, Any]:
    """[roles] runs: each trained role's version, nodes serving it, and reward curves ({} for
    the single policy)."""
    names = sorted({*snap.versions.roles, *snap.role_rewards})
    out = {}
    for name in names:
        train, val = snap.role_rewards.get(name, ([], []))
        out[name] = {
            "version": snap.versions.roles.get(name),
            "nodes": {n.node: n.version for n in snap.versions.nodes if n.role == name},
            "rewards": {"train": reward_points(train), "val": reward_points(val)},
        }
    return out


def _metrics(metrics: runstate.MetricsState) -> dict[str, Any]:
    series = {name: [[step, value] for step, value in points] for name, points in metrics.series.items()}
    last = metrics.last
    return {
        "series": series,
        "last": {"step": last.step, "version": last.version, "time": last.time} if last is not None else {},
    }


def _events(snap: runstate.RunSnapshot) -> list[dict[str, Any]]:
    return [
        {
            "time": e.time,
            "service": e.service,
            "name": e.name,
            "fields": json.loads(json.dumps(e.fields, default=str)),
        }
        for e in snap.events
    ]


def render(snap: runstate.RunSnapshot) -> dict[str, Any]:
    """The snapshot as JSON-ready data: the one shape every view of a run starts from."""
    return {
        "run": snap.run,
        "time": snap.time,
        "streams": {name: s.length for name, s in snap.streams.items()},
        "groups": _groups(snap),
        "ledger": _ledger(snap.ledger),
        "heartbeats": _heartbeats(snap),
        "versions": _versions(snap.versions),
        "rewards": {"train": reward_points(snap.train_rewards), "val": reward_points(snap.val_rewards)},
        "roles": _roles(snap),
        "metrics": _metrics(snap.metrics),
        "deadletters": [{"entry": d.entry, **d.fields} for d in snap.deadletters],
        "events": _events(snap),
        "skipped": snap.skipped,
        "warnings": [w.fields() for w in snap.warnings],
        "scheduler": snap.scheduler,
        "open_groups": snap.open_groups,
        "finished": snap.finished,
        "end": dataclasses.asdict(snap.end) if snap.end is not None else None,
    }


def snapshot(r: redis.Redis, keys: Keys, thresholds: Any = None) -> dict[str, Any]:
    """Read the run (and its tool pool) and render it for the page; with `thresholds`
    (monitor.stalls.Thresholds), the stalls found now too."""
    from squall.toolpool.summary import pool_summary

    from .stalls import detect

    stalls = [s.fields() for s in detect(r, keys, thresholds)] if thresholds is not None else []
    return {**render(runstate.read_snapshot(r, keys)), "tools": pool_summary(r, keys.run), "stalls": stalls}

"""The dashboard's JSON: `shared.runstate.read_snapshot` rendered for the page and /api/state.

Nothing here reads Redis itself; it only shapes the one snapshot every view of a run uses
(see shared/runstate.py for what is read, and how malformed entries are skipped and counted).
Numbers that are not finite never reach the page (JSON has no NaN).
"""

from __future__ import annotations

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
    nodes = [{"node": n.node, "version": n.version, "behind": n.behind} for n in versions.nodes]
    return {"trainer": versions.trainer, "nodes": nodes, "max_behind": versions.max_behind}


def _curve(points: list[Any]) -> list[dict[str, Any]]:
    return [{"version": p.version, "mean": p.mean, "count": p.count, "time": _finite(p.time)} for p in points]


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
    """Everything the dashboard shows, as JSON-ready data."""
    return {
        "run": snap.run,
        "time": snap.time,
        "streams": {name: s.length for name, s in snap.streams.items()},
        "groups": _groups(snap),
        "ledger": _ledger(snap.ledger),
        "heartbeats": _heartbeats(snap),
        "versions": _versions(snap.versions),
        "rewards": {"train": _curve(snap.train_rewards), "val": _curve(snap.val_rewards)},
        "metrics": _metrics(snap.metrics),
        "deadletters": [{"entry": d.entry, **d.fields} for d in snap.deadletters],
        "events": _events(snap),
        "skipped": snap.skipped,
        "warnings": [w.fields() for w in snap.warnings],
    }


def snapshot(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Read the run (and its tool pool) and render it for the page."""
    from squall.worker.status import pool_summary

    return {**render(runstate.read_snapshot(r, keys)), "tools": pool_summary(r, keys.run)}

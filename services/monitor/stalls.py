"""Stall detection: a run that stopped making progress, said before a deadline notices.

Five detectors, each read from Redis in one pass with the read-only monitor user's commands
(XRANGE, XREVRANGE, XPENDING, XINFO, HGETALL), so `squall status`, the dashboard and the
scheduler all find the same stalls without keeping any history of their own:

| kind | what it means | read from |
|---|---|---|
| `trainer_stalled` | the trainer's step has not moved for `step_stall_s` while trajectories have waited for it as long | newest `metrics` entry; the trainer group's oldest waiting entry |
| `group_slow` | a group still rolling out is older than K x the median age of those rolling out | `groups` hash |
| `runner_stuck` | a runner whose heartbeat is fresh holds an attempt past its deadline | XPENDING of `tasks`/`runners`; `heartbeats` |
| `node_stale` | a node serves a version more than `max_staleness` behind, for `node_stale_s` | `versions` hash; `weights` (when each version came) |
| `deadletters_rising` | more dead letters in the last window than in the one before, and at least `deadletter_min` | `deadletter` entry ids (their time) |

`StallWatch` (run by the scheduler, which may write `events`) turns the found set into events:
`stall` when one appears and `stall_cleared` (with how long it lasted) when it goes.
`StallCollector` exports them to Prometheus; deploy/prometheus/alerts.yml alerts on them.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from squall.shared import schemas
from squall.shared.heartbeat import is_alive, read_heartbeats
from squall.shared.keys import GROUP_RUNNERS, GROUP_TRAINER, Keys

KINDS = ("trainer_stalled", "group_slow", "runner_stuck", "node_stale", "deadletters_rising")
PENDING_SCAN = 1000  # pending task entries looked at per check (the oldest first)
DEADLETTER_SCAN = 10_000  # dead letters counted per window at most
WEIGHTS_SCAN = 200  # newest weight announcements read to date versions


@dataclass(frozen=True)
class Thresholds:
    """When a slow thing becomes a stall (AlertsSection and the scheduler's bounds, resolved)."""

    step_stall_s: float = 600.0
    slow_group_factor: float = 3.0
    slow_group_min_s: float = 60.0
    attempt_stuck_s: float = 150.0
    max_staleness: int = 1  # versions a node may be behind the trainer
    node_stale_s: float = 60.0
    deadletter_window_s: float = 300.0
    deadletter_min: int = 5

    @classmethod
    def from_config(cls, config: Any) -> Thresholds:
        """From a RunConfig: its [alerts] section and the scheduler's staleness and timeout."""
        alerts = config.alerts
        return cls(
            step_stall_s=alerts.step_stall_s,
            slow_group_factor=alerts.slow_group_factor,
            slow_group_min_s=alerts.slow_group_min_s,
            attempt_stuck_s=alerts.attempt_stuck_s
            or config.scheduler.task_timeout_s + config.scheduler.attempt_timeout_s + 30.0,
            max_staleness=config.trainer.max_sample_age,  # older turns are filtered as stale
            node_stale_s=alerts.node_stale_s,
            deadletter_window_s=alerts.deadletter_window_s,
            deadletter_min=alerts.deadletter_min,
        )


@dataclass(frozen=True)
class Stall:
    kind: str  # one of KINDS
    subject: str  # what is stalled: `trainer`, a group id, a runner id, a node, `deadletter`
    message: str  # what is wrong and where to look, for people
    seconds: float  # how long it has been so (for a rising rate: the window)
    value: float  # the number behind it: seconds waited, age, versions behind, dead letters

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.subject}"

    def fields(self) -> dict[str, Any]:
        return asdict(self)


def _id_time(entry_id: Any) -> float:
    """Unix time of a stream entry id (`<ms>-<seq>`)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0]) / 1000.0


def _oldest_waiting(r: redis.Redis, keys: Keys) -> float | None:
    """Time of the oldest trajectory the trainer has not acknowledged (pending or undelivered)."""
    try:
        summary: Any = r.xpending(keys.trajectories, GROUP_TRAINER)
        groups: Any = r.xinfo_groups(keys.trajectories)
    except redis.ResponseError:  # no stream or no group yet: nothing waits
        return None
    times = []
    if summary and summary.get("pending"):
        times.append(_id_time(summary["min"]))
    info = next((g for g in groups if g["name"] in (GROUP_TRAINER, GROUP_TRAINER.encode())), None)
    if info is not None:
        after = info["last-delivered-id"]
        after = after.decode() if isinstance(after, bytes) else after
        first: Any = r.xrange(keys.trajectories, min=f"({after}", count=1)
        if first:
            times.append(_id_time(first[0][0]))
    return min(times) if times else None


def trainer_stalled(r: redis.Redis, keys: Keys, t: Thresholds, now: float) -> list[Stall]:
    waiting_since = _oldest_waiting(r, keys)
    if waiting_since is None:
        return []
    newest: Any = r.xrevrange(keys.metrics, count=1)
    last_step_time, step = None, None
    if newest:
        try:
            message = schemas.decode(newest[0][1][schemas.ENTRY_FIELD], schemas.Metrics)
            last_step_time, step = message.time, message.step
        except Exception:  # a foreign entry: fall back to the entry's own time
            last_step_time = _id_time(newest[0][0])
    since = max(waiting_since, last_step_time or 0.0)
    stalled = now - since
    if stalled < t.step_stall_s:
        return []
    said = f"step {step}" if step is not None else "no step yet"
    return [
        Stall(
            "trainer_stalled",
            "trainer",
            f"the trainer has made no step for {stalled:.0f}s ({said}) while trajectories wait for it "
            f"since {now - waiting_since:.0f}s: is it paused, stuck loading, or out of memory? "
            "(its log, `squall status` processes)",
            stalled,
            stalled,
        )
    ]


def group_slow(r: redis.Redis, keys: Keys, t: Thresholds, now: float) -> list[Stall]:
    ages: dict[str, float] = {}
    for group_id, raw in r.hgetall(keys.groups).items():  # type: ignore[union-attr]
        try:
            body = json.loads(raw)
            if body.get("rolled_out"):
                continue  # done rolling out, held until the trainer consumes it
            ages[group_id.decode()] = now - float(body["created"])
        except (ValueError, KeyError, TypeError):
            continue
    if len(ages) < 2:
        return []  # one group cannot be slow against itself; the other detectors cover a lone one
    median = statistics.median(ages.values())
    bound = max(t.slow_group_factor * median, t.slow_group_min_s)
    return [
        Stall(
            "group_slow",
            group_id,
            f"group {group_id} has been rolling out for {age:.0f}s, over {t.slow_group_factor:g}x the median "
            f"{median:.0f}s of the {len(ages)} open groups: one of its attempts is slow or lost "
            "(`squall peek tasks`, the runners' logs)",
            age,
            age,
        )
        for group_id, age in sorted(ages.items())
        if age > bound
    ]


def runner_stuck(r: redis.Redis, keys: Keys, t: Thresholds, now: float) -> list[Stall]:
    alive = {
        name.split(":", 1)[1]
        for name, beat, _ in read_heartbeats(r, keys)
        if name.startswith("runner:") and is_alive(beat, now)
    }
    if not alive:
        return []
    try:
        rows: Any = r.xpending_range(keys.tasks, GROUP_RUNNERS, min="-", max="+", count=PENDING_SCAN)
    except redis.ResponseError:
        return []
    oldest: dict[str, tuple[float, int]] = {}  # runner -> (oldest held attempt's age, attempts held)
    for row in rows:
        runner = row["consumer"].decode() if isinstance(row["consumer"], bytes) else row["consumer"]
        age = now - _id_time(row["message_id"])
        held = oldest.get(runner, (0.0, 0))
        oldest[runner] = (max(held[0], age), held[1] + 1)
    return [
        Stall(
            "runner_stuck",
            runner,
            f"runner {runner} beats but has held an attempt for {age:.0f}s (past its deadline; "
            f"{count} held): its agent or reward is hung, or the runner cannot finish it (its log)",
            age,
            age,
        )
        for runner, (age, count) in sorted(oldest.items())
        if runner in alive and age > t.attempt_stuck_s
    ]


def _published_at(r: redis.Redis, keys: Keys) -> dict[int, float]:
    out: dict[int, float] = {}
    for entry_id, fields in r.xrevrange(keys.weights, count=WEIGHTS_SCAN):  # type: ignore[union-attr]
        try:
            message = schemas.decode(fields[schemas.ENTRY_FIELD], schemas.WeightVersion)
            out[message.version] = message.created_at
        except Exception:
            out.setdefault(-1, _id_time(entry_id))
    return out


def node_stale(r: redis.Redis, keys: Keys, t: Thresholds, now: float) -> list[Stall]:
    raw: Any = r.hgetall(keys.versions)
    versions = {k.decode(): int(v) for k, v in raw.items() if v.isdigit()}
    trainer = versions.pop("trainer", None)
    if trainer is None:
        return []
    behind = {name: trainer - v for name, v in versions.items() if trainer - v > t.max_staleness}
    if not behind:
        return []
    published = _published_at(r, keys)
    stalls = []
    for name, gap in sorted(behind.items()):
        node = name.split(":", 1)[1] if name.startswith("inference:") else name
        first_missed = versions[name] + t.max_staleness + 1  # the first version it should serve by now
        since = now - published.get(first_missed, now - t.node_stale_s)  # unknown: already long enough
        if since < t.node_stale_s:
            continue
        stalls.append(
            Stall(
                "node_stale",
                node,
                f"inference node {node} serves v{versions[name]}, {gap} behind the trainer's "
                f"v{trainer} (bound {t.max_staleness}) for {since:.0f}s: its reload fails or it "
                "does not follow `weights` (its log, `squall peek weights:applied`)",
                since,
                gap,
            )
        )
    return stalls


def _count_between(r: redis.Redis, stream: str, start: float, end: float) -> int:
    entries: Any = r.xrange(
        stream, min=str(int(start * 1000)), max=str(int(end * 1000)), count=DEADLETTER_SCAN
    )
    return len(entries)


def deadletters_rising(r: redis.Redis, keys: Keys, t: Thresholds, now: float) -> list[Stall]:
    window = t.deadletter_window_s
    recent = _count_between(r, keys.deadletter, now - window, now)
    before = _count_between(r, keys.deadletter, now - 2 * window, now - window - 0.001)
    if recent < t.deadletter_min or recent <= before:
        return []
    return [
        Stall(
            "deadletters_rising",
            "deadletter",
            f"{recent} dead letters in the last {window:.0f}s, up from {before} the {window:.0f}s before: "
            "read their reasons (`squall peek deadletter`)",
            window,
            recent,
        )
    ]


DETECTORS = (trainer_stalled, group_slow, runner_stuck, node_stale, deadletters_rising)


def detect(r: redis.Redis, keys: Keys, thresholds: Thresholds, now: float | None = None) -> list[Stall]:
    """Every stall of the run now, in KINDS order."""
    now = time.time() if now is None else now
    return [stall for detector in DETECTORS for stall in detector(r, keys, thresholds, now)]


def thresholds_for(r: redis.Redis, keys: Keys, fallback: Any) -> Thresholds:
    """The run's own thresholds when `squall up` stored its config in Redis, else `fallback`'s
    (the RunConfig of the command that asks)."""
    from squall.shared.config import RunConfig

    raw = r.hget(keys.config, "json")
    if raw:
        try:
            return Thresholds.from_config(RunConfig.model_validate_json(raw))  # type: ignore[arg-type]
        except ValueError:
            pass
    return Thresholds.from_config(fallback)


class StallWatch:
    """The scheduler's part: look every `every_s`, write `stall` / `stall_cleared` events on
    changes (a restarted scheduler says the ones still there again), keep `active` for /metrics."""

    def __init__(self, r: redis.Redis, keys: Keys, thresholds: Thresholds, every_s: float, log: Any) -> None:
        self.r, self.keys, self.thresholds, self.every_s, self.log = r, keys, thresholds, every_s, log
        self.active: dict[str, Stall] = {}
        self.started: dict[str, float] = {}  # stall key -> when this watch first saw it
        self.last = 0.0

    def maybe_check(self) -> list[Stall]:
        if time.monotonic() - self.last < self.every_s:
            return list(self.active.values())
        self.last = time.monotonic()
        return self.check()

    def check(self) -> list[Stall]:
        from squall.scheduler import report

        found = {s.key: s for s in detect(self.r, self.keys, self.thresholds)}
        now = time.time()
        for key, stall in found.items():
            if key not in self.active:
                self.started[key] = now
                report.event(self.r, self.keys, "stall", **stall.fields())
                self.log.warning("stall", kind=stall.kind, subject=stall.subject, message=stall.message)
        for key, stall in self.active.items():
            if key not in found:
                lasted = round(now - self.started.pop(key, now), 3)
                report.event(
                    self.r, self.keys, "stall_cleared", kind=stall.kind, subject=stall.subject, seconds=lasted
                )
                self.log.info("stall_cleared", kind=stall.kind, subject=stall.subject, seconds=lasted)
        self.active = found
        return list(found.values())


class StallCollector(Collector):
    """`squall_stalls{kind}` (stalls found now) and `squall_stall_seconds{kind}` (the longest),
    read at scrape time; every kind is exported, 0 when clear, so alert rules see the series.
    A Redis error yields no samples, never raises."""

    def __init__(self, r: redis.Redis, keys: Keys, thresholds: Thresholds) -> None:
        self.r, self.keys, self.thresholds = r, keys, thresholds

    def collect(self) -> Iterator[GaugeMetricFamily]:
        count = GaugeMetricFamily("squall_stalls", "Stalls found now, by kind", labels=["kind"])
        longest = GaugeMetricFamily(
            "squall_stall_seconds", "How long the longest stall of a kind has lasted", labels=["kind"]
        )
        try:
            stalls = detect(self.r, self.keys, self.thresholds)
        except Exception:  # a scrape must not fail because Redis is briefly away
            return
        for kind in KINDS:
            mine = [s for s in stalls if s.kind == kind]
            count.add_metric([kind], len(mine))
            longest.add_metric([kind], max((s.seconds for s in mine), default=0.0))
        yield from (count, longest)

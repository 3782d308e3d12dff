"""One reading of a run's state out of Redis: the snapshot every view of a run renders.

`read_snapshot(r, keys)` returns a typed `RunSnapshot`; `squall status`, the dashboard's
`/api/state`, `squall up`'s progress line and summary, and the metrics `QueueCollector` all
call it and only format what it returns. It reads, never writes, and uses only commands the
read-only `monitor` ACL user holds (XLEN, XINFO GROUPS, XRANGE/XREVRANGE, HGETALL, HLEN).

Parts of the snapshot, each read by one function below:
- ledger: counts per state, `dispatched`, conservation (`balanced`) and attempts in flight;
- streams: every stream's length, and each consumer group's lag, pending and consumers;
- processes: every heartbeat, decoded as `schemas.Heartbeat`: alive, stopped (a clean exit)
  or gone (stale or undecodable), by `heartbeat.state_of`;
- versions: the `versions` hash (`trainer`, `inference:<node>`) and each node's distance behind;
- rewards: `schemas.RewardPoint` messages of stream `rewards`, split into train and val;
- metrics: trainer `schemas.Metrics` messages as one (step, value) series per name;
- recent dead letters and events; the scheduler's cursor and its open groups; the end-of-data
  handshake (shared.dataend: the data ran out, the trainer's last version);
- warnings: the run's `warnings` hash (shared.runwarnings), each raised once per run.

A malformed entry (a reward or metrics entry that does not decode, a heartbeat that is not
JSON) is skipped and counted in `skipped`, never an error: a view must keep showing the rest.
A reward point whose mean is not finite (a validation round with no ok attempt) carries no
point to draw and is left out without being counted.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from . import dataend, schemas
from .heartbeat import is_alive, read_heartbeats
from .keys import Keys
from .runwarnings import RunWarning, read_warnings

CURVE_POINTS = 2000  # newest entries of `rewards` and `metrics` a snapshot reads by default
RECENT = 8  # dead letters and events a snapshot lists


@dataclass(frozen=True)
class GroupState:
    """One consumer group of one stream, as XINFO GROUPS reports it."""

    stream: str  # short stream name (Keys.stream_names)
    group: str
    lag: int | None  # entries not yet delivered to the group; None when Redis cannot tell (after XDEL)
    pending: int  # delivered, not acknowledged
    consumers: int
    last_delivered: str  # entry id


@dataclass(frozen=True)
class StreamState:
    name: str  # short name (Keys.stream_names)
    length: int  # XLEN
    groups: tuple[GroupState, ...] = ()


@dataclass(frozen=True)
class LedgerState:
    counts: dict[str, int]  # state -> attempts in it (non-zero only), `dispatched` left out
    dispatched: int  # attempts ever dispatched

    @property
    def accounted(self) -> int:
        return sum(self.counts.values())

    @property
    def balanced(self) -> bool:
        """Conservation: every dispatched attempt is in exactly one state."""
        return self.accounted == self.dispatched

    @property
    def in_flight(self) -> int:
        return self.counts.get("pending", 0) + self.counts.get("running", 0)

    def with_dispatched(self) -> dict[str, int]:
        """The counts as `Ledger.counts()` spells them: `dispatched` plus each state."""
        return {"dispatched": self.dispatched, **self.counts}


@dataclass(frozen=True)
class ProcessState:
    """One field of the `heartbeats` hash."""

    id: str  # `<service>:<instance>`
    beat: schemas.Heartbeat | None  # None when the field does not decode (see `error`)
    error: str  # why it did not decode ("" when it did)
    age_s: float | None  # seconds since its last beat (None: unknown)
    alive: bool  # not stopped, and younger than heartbeat.STALE_AFTER_S

    @property
    def service(self) -> str:
        return self.id.split(":", 1)[0]

    @property
    def state(self) -> str:
        """`alive`, `stopped` (it exited cleanly) or `gone` (it died, or its beat is unreadable)."""
        if self.alive:
            return "alive"
        return "stopped" if self.beat is not None and self.beat.stopped else "gone"

    def fields(self) -> dict[str, Any]:
        """What the process said, flat, as it stands in Redis: pid, version, port, its stats."""
        if self.beat is None:
            return {"error": self.error}
        b = self.beat
        return {"pid": b.pid, "version": b.version, "metrics_port": b.metrics_port, **b.stats}


@dataclass(frozen=True)
class NodeVersion:
    node: str  # inference node name
    version: int
    behind: int | None  # trainer version minus this one (None: no trainer version yet)
    role: str = "policy"  # the trained role whose adapter this is ([roles] runs: one entry per role)


@dataclass(frozen=True)
class VersionsState:
    raw: dict[str, int]  # the `versions` hash: `trainer`, `inference:<node>` -> version
    # ([roles] runs: `trainer:<role>`, `inference:<node>:<role>`, shared.roles)

    @property
    def trainer(self) -> int | None:
        return self.raw.get("trainer")

    @property
    def roles(self) -> dict[str, int]:
        """Each trained role's published version ([roles] runs; {} for the single policy)."""
        return {
            name.split(":", 1)[1]: v for name, v in sorted(self.raw.items()) if name.startswith("trainer:")
        }

    @property
    def nodes(self) -> list[NodeVersion]:
        out = []
        roles = self.roles
        for name, version in sorted(self.raw.items()):
            if name == "trainer" or name.startswith("trainer:"):
                continue
            node = name.split(":", 1)[1] if name.startswith("inference:") else name
            role = "policy"
            if name.startswith("inference:") and node.rpartition(":")[2] in roles:
                node, _, role = node.rpartition(":")
            trainer = roles.get(role) if role != "policy" else self.trainer
            behind = trainer - version if trainer is not None else None
            out.append(NodeVersion(node, version, behind, role))
        return out

    @property
    def max_behind(self) -> int | None:
        behinds = [n.behind for n in self.nodes if n.behind is not None]
        return max(behinds) if behinds else None


@dataclass(frozen=True)
class MetricsState:
    series: dict[str, list[tuple[int, float]]]  # metric name -> (step, value) in step order
    last: schemas.Metrics | None  # the newest step's message

    def latest(self, *names: str, default: float = 0.0) -> float:
        """The newest step's value of the first of `names` it has."""
        if self.last is not None:
            for name in names:
                if name in self.last.values:
                    return float(self.last.values[name])
        return default


@dataclass(frozen=True)
class DeadLetter:
    entry: str  # id in `deadletter`
    fields: dict[str, str]  # source, entry_id, reason...; the raw bytes left out


@dataclass(frozen=True)
class RunSnapshot:
    """Everything a view of the run shows, read at `time`."""

    run: str
    time: float  # wall clock of the reading
    ledger: LedgerState
    streams: dict[str, StreamState]  # short name -> state, in Keys.stream_names order
    processes: list[ProcessState]  # sorted by id
    versions: VersionsState
    train_rewards: list[schemas.RewardPoint]  # stream order (one per finished train group)
    val_rewards: list[schemas.RewardPoint]  # one per validation round with a finite mean
    metrics: MetricsState
    deadletters: list[DeadLetter]  # newest first
    events: list[schemas.Event]  # newest first
    scheduler: dict[str, str]  # the scheduler's cursor hash (epoch, samples, paused...)
    open_groups: int  # fields of the `groups` hash
    end: dataend.DataEnd | None = None  # the end-of-data handshake (None: not read)
    skipped: dict[str, int] = field(default_factory=dict)  # part -> malformed entries left out
    warnings: list[RunWarning] = field(default_factory=list)  # oldest first
    # [roles] runs: role -> (its train points, its val points); the lists above are the attempts'
    role_rewards: dict[str, tuple[list[schemas.RewardPoint], list[schemas.RewardPoint]]] = field(
        default_factory=dict
    )

    @property
    def groups(self) -> list[GroupState]:
        return [g for s in self.streams.values() for g in s.groups]

    def group(self, stream: str, group: str) -> GroupState | None:
        return next((g for g in self.groups if g.stream == stream and g.group == group), None)

    @property
    def finished(self) -> bool:
        """The scheduler finished the run (its cursor's `finished`)."""
        return self.scheduler.get("finished") == "1"

    def alive(self, service: str | None = None) -> list[ProcessState]:
        return [p for p in self.processes if p.alive and (service is None or p.service == service)]


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _count(skipped: dict[str, int], part: str) -> None:
    skipped[part] = skipped.get(part, 0) + 1


def read_ledger(r: redis.Redis, keys: Keys) -> LedgerState:
    raw: dict[bytes, bytes] = r.hgetall(keys.ledger)  # type: ignore[assignment]
    counts = {_text(k): int(v) for k, v in raw.items() if int(v)}
    dispatched = counts.pop("dispatched", 0)
    return LedgerState(counts=dict(sorted(counts.items())), dispatched=dispatched)


def _group_state(stream: str, info: dict[Any, Any]) -> GroupState:
    lag = info.get("lag")
    return GroupState(
        stream=stream,
        group=_text(info["name"]),
        lag=int(lag) if lag is not None else None,
        pending=int(info["pending"]),
        consumers=int(info["consumers"]),
        last_delivered=_text(info.get("last-delivered-id", "")),
    )


def read_streams(r: redis.Redis, keys: Keys) -> dict[str, StreamState]:
    """Every stream's length and groups, in two round trips (a missing stream has length 0)."""
    names = keys.stream_names()
    pipe = r.pipeline(transaction=False)
    for key in names.values():
        pipe.xlen(key)
    for key in names.values():
        pipe.xinfo_groups(key)
    replies = pipe.execute(raise_on_error=False)
    lengths, infos = replies[: len(names)], replies[len(names) :]
    out = {}
    for name, length, info in zip(names, lengths, infos, strict=True):
        if isinstance(length, Exception):
            raise length
        groups = () if isinstance(info, redis.ResponseError) else tuple(_group_state(name, g) for g in info)
        out[name] = StreamState(name=name, length=int(length), groups=groups)
    return out


def read_processes(r: redis.Redis, keys: Keys, now: float) -> list[ProcessState]:
    rows = []
    for name, beat, error in read_heartbeats(r, keys):
        age = now - beat.time if beat is not None else None
        rows.append(ProcessState(id=name, beat=beat, error=error, age_s=age, alive=is_alive(beat, now)))
    return rows


def read_versions(r: redis.Redis, keys: Keys) -> VersionsState:
    raw = {}
    for name, value in r.hgetall(keys.versions).items():  # type: ignore[union-attr]
        try:
            raw[_text(name)] = int(value)
        except ValueError:
            continue
    return VersionsState(raw=raw)


def _newest(r: redis.Redis, stream: str, count: int | None) -> list[tuple[Any, dict[Any, Any]]]:
    """The newest `count` entries (None: all) in stream order."""
    if count is None:
        return r.xrange(stream)  # type: ignore[return-value]
    if count <= 0:
        return []
    return list(reversed(r.xrevrange(stream, count=count)))  # type: ignore[arg-type]


def decode_entry(fields: dict[Any, Any], kind: type[schemas.Message]) -> Any:
    """The entry's message, or None when it does not decode as `kind`: a reader of run state
    skips (and counts) a bad entry, it never stops on one."""
    try:
        return schemas.decode(fields.get(schemas.ENTRY_FIELD, b""), kind)
    except Exception:  # SchemaError, or anything a foreign writer put there
        return None


def read_rewards(
    r: redis.Redis,
    keys: Keys,
    count: int | None,
    skipped: dict[str, int],
    by_role: dict[str, tuple[list[schemas.RewardPoint], list[schemas.RewardPoint]]] | None = None,
) -> tuple[list[schemas.RewardPoint], list[schemas.RewardPoint]]:
    """RewardPoint messages of the newest `count` entries (None: all) as (train, val); a
    role's own points ([roles] runs) go to `by_role` instead (left out when it is None)."""
    train: list[schemas.RewardPoint] = []
    val: list[schemas.RewardPoint] = []
    for _, fields in _newest(r, keys.rewards, count):
        point = decode_entry(fields, schemas.RewardPoint)
        if point is None:
            _count(skipped, "rewards")
            continue
        if not math.isfinite(point.mean):
            continue
        if point.role:
            if by_role is not None:
                role_train, role_val = by_role.setdefault(point.role, ([], []))
                (role_val if point.mode == "val" else role_train).append(point)
            continue
        (val if point.mode == "val" else train).append(point)
    return train, val


def read_metrics(r: redis.Redis, keys: Keys, count: int | None, skipped: dict[str, int]) -> MetricsState:
    series: dict[str, list[tuple[int, float]]] = {}
    last = None
    for _, fields in _newest(r, keys.metrics, count):
        message = decode_entry(fields, schemas.Metrics)
        if message is None:
            _count(skipped, "metrics")
            continue
        for name, value in message.values.items():
            if math.isfinite(value):
                series.setdefault(name, []).append((message.step, float(value)))
        last = message
    return MetricsState(series=dict(sorted(series.items())), last=last)


def read_deadletters(r: redis.Redis, keys: Keys, count: int) -> list[DeadLetter]:
    rows = []
    for entry_id, fields in _newest(r, keys.deadletter, count)[::-1]:
        text = {_text(k): _text(v)[:300] for k, v in fields.items() if _text(k) != "raw"}
        rows.append(DeadLetter(entry=_text(entry_id), fields=text))
    return rows


def read_events(r: redis.Redis, keys: Keys, count: int) -> list[schemas.Event]:
    events = (decode_entry(fields, schemas.Event) for _, fields in _newest(r, keys.events, count)[::-1])
    return [event for event in events if event is not None]


def read_snapshot(
    r: redis.Redis,
    keys: Keys,
    *,
    rewards: int | None = CURVE_POINTS,
    metrics: int | None = CURVE_POINTS,
    recent: int = RECENT,
) -> RunSnapshot:
    """The run as it stands. `rewards`/`metrics`: newest entries read (None: all, 0: none);
    `recent`: dead letters and events listed."""
    now = time.time()
    skipped: dict[str, int] = {}
    by_role: dict[str, tuple[list[schemas.RewardPoint], list[schemas.RewardPoint]]] = {}
    train, val = read_rewards(r, keys, rewards, skipped, by_role)
    return RunSnapshot(
        run=keys.run,
        time=now,
        ledger=read_ledger(r, keys),
        streams=read_streams(r, keys),
        processes=read_processes(r, keys, now),
        versions=read_versions(r, keys),
        train_rewards=train,
        val_rewards=val,
        metrics=read_metrics(r, keys, metrics, skipped),
        deadletters=read_deadletters(r, keys, recent),
        events=read_events(r, keys, recent),
        scheduler={_text(k): _text(v) for k, v in r.hgetall(keys.scheduler_state).items()},  # type: ignore[union-attr]
        open_groups=int(r.hlen(keys.groups)),  # type: ignore[arg-type]
        end=dataend.read(r, keys),
        warnings=read_warnings(r, keys, skipped),
        skipped=skipped,
        role_rewards=by_role,
    )

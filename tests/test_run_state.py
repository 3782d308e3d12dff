"""shared/runstate.py: the one run-snapshot reader, on a real Redis written by the real writers
(HeartbeatWriter, bus.publish of RewardPoint/Metrics, Ledger moves); and the views that
render it (`squall status`, the dashboard, `squall up`'s progress) agreeing with it."""

from __future__ import annotations

import json
import math
import time

import pytest

from squall.local.progress import snapshot as progress_state
from squall.monitor.snapshot_json import snapshot as dashboard_state
from squall.monitor.status import collect
from squall.shared import bus, schemas
from squall.shared.heartbeat import STALE_AFTER_S, HeartbeatWriter
from squall.shared.keys import GROUP_RUNNERS, Keys
from squall.shared.ledger import Ledger
from squall.shared.runstate import read_snapshot

pytestmark = pytest.mark.redis


def _point(run: str, version: int, mode: str, mean: float, group: str) -> schemas.RewardPoint:
    return schemas.RewardPoint(run=run, version=version, mode=mode, mean=mean, count=4, group_id=group)


def _fill(r, run: str) -> Keys:
    keys = Keys(run)
    for v in range(3):
        bus.publish(r, keys.rewards, _point(run, v, "train", 0.1 * v, f"g{v}"))
    bus.publish(r, keys.rewards, _point(run, 2, "val", 0.5, "round1"))
    bus.publish(r, keys.rewards, _point(run, 3, "val", math.nan, "round2"))  # no ok attempt: no point
    r.xadd(keys.rewards, {"version": 1, "mode": "train", "mean": 0.3})  # the old raw form: skipped
    for step in (1, 2):
        bus.publish(r, keys.metrics, schemas.Metrics(run=run, step=step, version=step,
                                                     values={"loss": 1.0 / step, "tokens_per_s": 100.0 * step}))  # fmt: skip
    tasks = [
        schemas.Task(run=run, task_id=f"g9:{i}", group_id="g9", sample_id="s", index=i, group_size=3, payload={},
                     deadline=2e9)
        for i in range(3)
    ]  # fmt: skip
    bus.ensure_group(r, keys.tasks, GROUP_RUNNERS)
    bus.publish_many(r, keys.tasks, tasks)
    Ledger(r, keys).move([t.key for t in tasks], "pending", allowed_from=["new"])
    consumer = bus.GroupConsumer(r, keys.tasks, GROUP_RUNNERS, "runner-0", kind=schemas.Task,
                                 deadletter_stream=keys.deadletter)  # fmt: skip
    consumer.read(1, block_ms=10)
    r.hset(keys.versions, mapping={"trainer": 5, "inference:a": 5, "inference:b": 3})
    return keys


def test_snapshot_reads_typed_parts_and_counts_what_it_skips(r, run_name):
    keys = _fill(r, run_name)
    HeartbeatWriter(r, keys, "runner", "host-1", every_s=0).beat(version=4, busy=2, slots=4)
    stale = HeartbeatWriter(r, keys, "runner", "host-2", every_s=0).build()
    stale.time = time.time() - STALE_AFTER_S - 1
    r.hset(keys.heartbeats, stale.hash_field, schemas.encode_heartbeat(stale))
    r.hset(keys.heartbeats, "trainer:x", b"not json")

    snap = read_snapshot(r, keys)
    assert [(p.version, p.mean) for p in snap.train_rewards] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert [p.group_id for p in snap.val_rewards] == ["round1"]  # the NaN round carries no point
    assert snap.skipped == {"rewards": 1}
    assert (
        snap.metrics.series["loss"] == [(1, 1.0), (2, 0.5)] and snap.metrics.latest("tokens_per_s") == 200.0
    )
    assert snap.ledger.dispatched == 3 and snap.ledger.balanced and snap.ledger.in_flight == 3
    group = snap.group("tasks", GROUP_RUNNERS)
    assert group is not None and (group.lag, group.pending, group.consumers) == (2, 1, 1)
    assert snap.streams["tasks"].length == 3 and snap.streams["weights"].length == 0
    assert snap.versions.trainer == 5 and snap.versions.max_behind == 2
    alive = {p.id: p.alive for p in snap.processes}
    assert alive == {"runner:host-1": True, "runner:host-2": False, "trainer:x": False}
    fresh = next(p for p in snap.processes if p.id == "runner:host-1")
    assert fresh.fields()["busy"] == 2.0 and fresh.beat is not None and fresh.beat.version == 4
    broken = next(p for p in snap.processes if p.id == "trainer:x")
    assert broken.beat is None and "not JSON" in broken.error


def test_every_view_renders_the_same_reading(r, run_name):
    keys = _fill(r, run_name)
    HeartbeatWriter(r, keys, "runner", "host-1", every_s=0).beat()
    status = collect(r, run_name, rewards=4)
    page = dashboard_state(r, keys)
    progress = progress_state(r, keys)
    json.dumps(page, allow_nan=False)
    assert (
        status["ledger"]["dispatched"]
        == page["ledger"]["dispatched"]
        == progress["ledger"]["dispatched"]
        == 3
    )
    assert status["ledger"]["balanced"] and page["ledger"]["balanced"] and progress["ledger"]["balanced"]
    assert status["runners_alive"] == 1
    # the newest 4 entries: train v2, val round1, the NaN round (no point), the raw one (skipped)
    assert [(p["mode"], p["version"]) for p in status["recent_rewards"]] == [("train", 2), ("val", 2)]
    assert [p["version"] for p in page["rewards"]["train"]] == [
        p["version"] for p in progress["rewards"]["train"]
    ]
    assert progress["step"] == 2 and progress["tokens_per_s"] == 200.0
    assert math.isclose(progress["train_reward"], 0.1)
    assert status["versions"]["raw"] == {"trainer": 5, "inference:a": 5, "inference:b": 3}
    assert page["versions"]["max_behind"] == 2

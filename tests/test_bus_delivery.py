"""Delivery through consumer groups across processes: exactly-once processing, reclaim after
kill -9, lease renewal, and trimming that never removes an unacknowledged entry."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_for

from squall.shared import bus, schemas
from squall.shared.keys import Keys

WORKER = Path(__file__).with_name("busworker.py")
pytestmark = pytest.mark.redis


def tasks(n: int, run: str = "r") -> list[schemas.Task]:
    return [
        schemas.Task(run=run, task_id=f"g{i}:0", group_id=f"g{i}", sample_id=str(i), index=0, group_size=1,
                     payload={"i": i}, deadline=1e10)
        for i in range(n)
    ]  # fmt: skip


def start_worker(redis_url: str, stream: str, name: str, mode: str = "work") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), redis_url, stream, "g", name, mode])


def finish(r, stream: str, workers: list[subprocess.Popen]) -> None:
    r.set(f"{stream}:done", 1)
    for worker in workers:
        assert worker.wait(timeout=30) in (0, -signal.SIGKILL)


def assert_each_processed_once(r, stream: str, n: int) -> None:
    processed = {k.decode(): int(v) for k, v in r.hgetall(f"{stream}:processed").items()}
    assert len(processed) == n, f"{n - len(processed)} entries lost"
    doubled = {k: v for k, v in processed.items() if v != 1}
    assert not doubled, f"processed more than once: {list(doubled)[:5]}"
    assert r.xpending(stream, "g")["pending"] == 0


@pytest.mark.slow
def test_four_consumers_drain_20000_exactly_once(r, redis_url, run_name):
    stream, n = Keys(run_name).tasks, 20_000
    bus.ensure_group(r, stream, "g")
    for start in range(0, n, 1000):
        bus.publish_many(r, stream, tasks(n)[start : start + 1000])
    workers = [start_worker(redis_url, stream, f"c{i}") for i in range(4)]
    wait_for(lambda: int(r.get(f"{stream}:count") or 0) >= n, 90, "20,000 entries processed")
    finish(r, stream, workers)
    assert_each_processed_once(r, stream, n)
    consumers = {c["name"].decode(): c for c in r.xinfo_consumers(stream, "g")}
    assert len([c for c in consumers.values() if c["pending"] == 0]) == 4


@pytest.mark.slow
def test_killed_consumer_entries_are_reclaimed(r, redis_url, run_name):
    stream, n = Keys(run_name).tasks, 2_000
    bus.ensure_group(r, stream, "g")
    bus.publish_many(r, stream, tasks(n))
    victim = start_worker(redis_url, stream, "victim", mode="hold")
    wait_for(lambda: r.exists(f"{stream}:held"), 20, "the victim to hold entries")
    held = r.xpending(stream, "g")["pending"]
    assert held == 200
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    workers = [start_worker(redis_url, stream, f"c{i}") for i in range(3)]
    wait_for(lambda: int(r.get(f"{stream}:count") or 0) >= n, 60, "all entries processed")
    finish(r, stream, workers)
    assert_each_processed_once(r, stream, n)


def test_renew_keeps_lease_and_refuses_entries_taken_by_others(r, run_name):
    stream = Keys(run_name).tasks
    bus.publish_many(r, stream, tasks(3))
    dl = Keys(run_name).deadletter
    a = bus.GroupConsumer(r, stream, "g", "a", kind=schemas.Task, deadletter_stream=dl)
    b = bus.GroupConsumer(r, stream, "g", "b", kind=schemas.Task, deadletter_stream=dl)
    mine = [d.entry_id for d in a.read(3, 100)]
    time.sleep(0.25)
    assert a.renew(mine[:2]) == mine[:2]  # renewed: idle reset
    reclaimed = b.reclaim(min_idle_ms=200)
    assert [d.entry_id for d in reclaimed] == [mine[2]]  # only the one not renewed
    assert reclaimed[0].deliveries == 2
    assert a.renew(mine) == mine[:2]  # a lost the third; renew must not steal it back
    owners = {
        row["message_id"].decode(): row["consumer"].decode()
        for row in r.xpending_range(stream, "g", "-", "+", 10)
    }
    assert owners == {mine[0]: "a", mine[1]: "a", mine[2]: "b"}


def test_trim_never_removes_unacked_entries(r, run_name):
    keys = Keys(run_name)
    stream = keys.trajectories
    dl = keys.deadletter
    ids = [bus.publish(r, stream, t) for t in tasks(100)]
    # The bus primitive with three groups: the run's two (trainer, scheduler) and a third
    # reader (an audit tool of someone's) that reads through a group of its own.
    assert keys.groups_of(stream) == ("trainer", "scheduler")
    groups = (*keys.groups_of(stream), "audit")
    consumers = {
        g: bus.GroupConsumer(r, stream, g, "c", kind=schemas.Task, deadletter_stream=dl) for g in groups
    }
    # Nothing delivered to anyone yet: nothing may go.
    assert bus.trim_acknowledged(r, stream, groups) == 0
    trainer, scheduler, audit = (consumers[g] for g in groups)
    trainer.ack([d.entry_id for d in trainer.read(100, 100)])  # trainer acked all
    got = scheduler.read(60, 100)
    scheduler.ack([d.entry_id for d in got[:30]] + [d.entry_id for d in got[40:]])  # 30..39 pending
    audit.ack([d.entry_id for d in audit.read(80, 100)])  # 80..99 undelivered
    assert bus.trim_acknowledged(r, stream, groups) == 30
    remaining = [e[0].decode() for e in r.xrange(stream)]
    assert remaining == ids[30:]
    # A group that is missing altogether blocks trimming.
    r.xgroup_destroy(stream, "audit")
    assert bus.trim_acknowledged(r, stream, groups) == 0
    assert r.xlen(stream) == 70

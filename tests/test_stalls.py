"""Stall detectors (services/monitor/stalls.py): each one triggered by a stall made to happen
against a real Redis, seen by `detect`, the scheduler's StallWatch (events), `squall status`,
/api/state and /metrics, and cleared once the stall ends. Thresholds are seconds, not minutes,
so each test takes a few seconds. The alert rules shipped in deploy/prometheus are checked
with promtool (Debian's `prometheus` package)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from optional import need
from prometheus_client import CollectorRegistry, generate_latest
from runner_helpers import Procs, dispatch
from waiting import wait_for

from squall.monitor.stalls import KINDS, StallCollector, StallWatch, Thresholds, detect
from squall.monitor.status import collect, render
from squall.scheduler.groups import Group
from squall.shared import bus, schemas
from squall.shared.config import RunConfig
from squall.shared.keys import GROUP_RUNNERS, GROUP_TRAINER, Keys
from squall.shared.logs import get_logger

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus"
FAST = Thresholds(step_stall_s=1.0, slow_group_factor=3.0, slow_group_min_s=1.0, attempt_stuck_s=1.0,
                  max_staleness=1, node_stale_s=0.5, deadletter_window_s=1.0, deadletter_min=3)  # fmt: skip


def kinds(r, run: str) -> set[str]:
    return {s.kind for s in detect(r, Keys(run), FAST)}


def events(r, run: str) -> list[schemas.Event]:
    found = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(Keys(run).events)]
    return [e for e in found if e.name in ("stall", "stall_cleared")]


def scrape(r, run: str) -> str:
    registry = CollectorRegistry()
    registry.register(StallCollector(r, Keys(run), FAST))
    return generate_latest(registry).decode()


def _trajectory(run: str, i: int) -> schemas.Trajectory:
    return schemas.Trajectory(run=run, task_id=f"g{i}:0", group_id=f"g{i}", sample_id=str(i), index=0,
                              group_size=1, attempt=0, runner_id="r", status="ok", reward=1.0)  # fmt: skip


def test_trainer_stalled_while_work_waits_then_cleared(r, run_name):
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = bus.GroupConsumer(r, keys.trajectories, GROUP_TRAINER, "trainer-0", kind=schemas.Trajectory,
                                deadletter_stream=keys.deadletter)  # fmt: skip
    bus.publish(r, keys.metrics, schemas.Metrics(run=run_name, step=1, version=1, values={"loss": 1.0}))
    watch = StallWatch(r, keys, FAST, every_s=0.0, log=get_logger(component="test"))
    assert watch.check() == []  # nothing waits: an idle trainer is not stalled
    for i in range(3):
        bus.publish(r, keys.trajectories, _trajectory(run_name, i))
    assert "trainer_stalled" not in kinds(r, run_name)  # work just arrived
    # The trainer is paused: work waits, its step does not move.
    wait_for(lambda: "trainer_stalled" in kinds(r, run_name), timeout_s=5, what="trainer_stalled")
    found = watch.check()
    assert [s.kind for s in found] == ["trainer_stalled"] and "step 1" in found[0].message
    assert 'squall_stalls{kind="trainer_stalled"} 1.0' in scrape(r, run_name)
    status = collect(r, run_name, config=RunConfig())  # the default thresholds: 600 s is far off
    assert status["stalls"] == []
    # The trainer comes back: it takes the work and makes a step.
    deliveries = trainer.read(10, block_ms=100)
    trainer.ack([d.entry_id for d in deliveries])
    bus.publish(r, keys.metrics, schemas.Metrics(run=run_name, step=2, version=2, values={"loss": 0.5}))
    assert watch.check() == []
    assert [(e.name, e.fields["kind"]) for e in events(r, run_name)] == [
        ("stall", "trainer_stalled"), ("stall_cleared", "trainer_stalled")]  # fmt: skip
    assert 'squall_stalls{kind="trainer_stalled"} 0.0' in scrape(r, run_name)


def test_slow_group_against_the_median(r, run_name):
    keys = Keys(run_name)
    now = time.time()

    def group(gid: str, created: float, rolled_out: bool = False) -> Group:
        return Group(group_id=gid, sample_id=gid, mode="train", version=0, size=2, epoch=0, created=created,
                     payload={}, attempts=[0, 0], done=[False, False], rewards=[None, None],
                     rolled_out=rolled_out)  # fmt: skip

    r.hset(keys.groups, mapping={g.group_id: g.to_json() for g in (group("slow", now), group("quick", now))})
    assert "group_slow" not in kinds(r, run_name)
    time.sleep(1.2)  # `quick` rolls out and new groups open; `slow` is still rolling out
    r.hset(keys.groups, "quick", group("quick", now, rolled_out=True).to_json())
    r.hset(keys.groups, mapping={f"new-{i}": group(f"new-{i}", time.time()).to_json() for i in range(3)})
    stalls = [s for s in detect(r, keys, FAST) if s.kind == "group_slow"]
    assert [s.subject for s in stalls] == ["slow"] and stalls[0].value > 1.0
    r.hset(keys.groups, "slow", group("slow", now, rolled_out=True).to_json())  # its last member finished
    assert "group_slow" not in kinds(r, run_name)


def test_node_pinned_behind_the_trainer_is_stale_until_it_catches_up(r, run_name):
    keys = Keys(run_name)
    r.hset(keys.versions, mapping={"trainer": 1, "inference:node-a": 1, "inference:node-b": 1})
    for version in (2, 3):  # the trainer publishes; node-b is pinned at v1, node-a follows
        bus.publish(r, keys.weights, schemas.WeightVersion(run=run_name, version=version, step=version,
                                                           location="/x", checksum="0"))  # fmt: skip
        r.hset(keys.versions, mapping={"trainer": version, "inference:node-a": version})
    assert "node_stale" not in kinds(r, run_name)  # v3 only just came: a reload takes time
    wait_for(lambda: "node_stale" in kinds(r, run_name), timeout_s=5, what="node_stale")
    stall = next(s for s in detect(r, keys, FAST) if s.kind == "node_stale")
    assert stall.subject == "node-b" and stall.value == 2 and "v1" in stall.message
    assert any(line.startswith("STALL      node_stale") for line in render(_status(r, run_name)).splitlines())
    r.hset(keys.versions, "inference:node-b", 3)
    assert "node_stale" not in kinds(r, run_name)


def _status(r, run: str) -> dict:
    config = RunConfig.model_validate({"alerts": {"node_stale_s": 0.5}, "trainer": {"max_sample_age": 1}})
    return collect(r, run, config=config)


def test_rising_dead_letter_rate(r, run_name):
    keys = Keys(run_name)
    bus.ensure_group(r, keys.tasks, GROUP_RUNNERS)
    consumer = bus.GroupConsumer(r, keys.tasks, GROUP_RUNNERS, "runner-x", kind=schemas.Task,
                                 deadletter_stream=keys.deadletter)  # fmt: skip
    for _ in range(4):
        r.xadd(keys.tasks, {"m": b"\x93not a task"})  # malformed: the runner's read dead-letters each
    consumer.read(10, block_ms=100)
    assert r.xlen(keys.deadletter) == 4
    assert "deadletters_rising" in kinds(r, run_name)
    assert 'squall_stalls{kind="deadletters_rising"} 1.0' in scrape(r, run_name)
    time.sleep(1.1)  # a window with none: the rate fell
    assert "deadletters_rising" not in kinds(r, run_name)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_runner_whose_agent_is_stopped_is_stuck_until_it_continues(r, redis_url, run_name, tmp_path):
    pid_file = tmp_path / "agent.pid"
    agent = (f"python3 -c \"import os,sys,time; sys.stdin.read(); open('{pid_file}','w').write(str(os.getpid())); "
             "time.sleep(1.5); print(1.0)\"")  # fmt: skip
    procs = Procs(redis_url, run_name, tmp_path)
    try:
        procs.start("runner", "--agent-cmd", agent, SQUALL_RUNNER__HEARTBEAT_S="0.3")
        dispatch(r, run_name, [{"question": "q"}], deadline_s=120)
        wait_for(pid_file.exists, timeout_s=30, what="the agent to start")
        wait_for(lambda: pid_file.read_text().strip(), timeout_s=5, what="the agent's pid")
        agent_pid = int(pid_file.read_text())
        os.kill(agent_pid, signal.SIGSTOP)  # the agent hangs; the runner itself keeps beating
        wait_for(lambda: "runner_stuck" in kinds(r, run_name), timeout_s=10, what="runner_stuck")
        stall = next(s for s in detect(r, Keys(run_name), FAST) if s.kind == "runner_stuck")
        beats = {k.decode() for k in r.hkeys(Keys(run_name).heartbeats)}
        assert f"runner:{stall.subject}" in beats
        os.kill(agent_pid, signal.SIGCONT)
        wait_for(lambda: r.xlen(Keys(run_name).trajectories) == 1, timeout_s=15, what="the attempt to finish")
        wait_for(lambda: "runner_stuck" not in kinds(r, run_name), timeout_s=5, what="runner_stuck to clear")
    finally:
        procs.stop_all()


def test_every_kind_has_an_alert_and_the_rules_pass_promtool(tmp_path):
    text = (RULES / "alerts.yml").read_text()
    assert set(re.findall(r'kind="([a-z_]+)"', text)) == set(KINDS)
    promtool = shutil.which("promtool")
    need("promtool", promtool is not None, "promtool is not installed (apt-get install prometheus)")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES / "alerts.yml")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"], cwd=RULES, capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    broken = tmp_path / "broken.yml"  # a negative control: promtool does catch a bad expression
    broken.write_text(
        text.replace('squall_stalls{kind="node_stale"}) > 0', 'squall_stalls{kind="node_stale"}) >')
    )
    assert subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True).returncode != 0


def test_scheduler_config_gives_the_thresholds():
    config = RunConfig.model_validate(
        {
            "scheduler": {"task_timeout_s": 50},
            "trainer": {"max_sample_age": 2},
            "alerts": {"step_stall_s": 30},
        }
    )
    t = Thresholds.from_config(config)
    assert (t.step_stall_s, t.attempt_stuck_s, t.max_staleness) == (30, 80, 2)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_scheduler_writes_stall_events_and_serves_the_gauge(r, redis_url, run_name, tmp_path):
    """A real scheduler: malformed trajectories it dead-letters raise `deadletters_rising`; it
    writes `stall`, its /metrics shows the gauge, and `stall_cleared` follows once the window passes."""
    import json

    import httpx
    from runner_helpers import events as all_events
    from runner_helpers import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "s0"}])
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false",
                  SQUALL_ALERTS__CHECK_EVERY_S="0.2", SQUALL_ALERTS__DEADLETTER_MIN="3",
                  SQUALL_ALERTS__DEADLETTER_WINDOW_S="2")  # fmt: skip
    keys = Keys(run_name)
    try:
        procs.start("scheduler", "--dataset", str(data), "--group-size", "2")
        beat = wait_for(
            lambda: r.hget(keys.heartbeats, next(iter(r.hkeys(keys.heartbeats)), b"-")), 30, "a beat"
        )
        for _ in range(4):
            r.xadd(keys.trajectories, {"m": b"\x93not a trajectory"})
        wait_for(lambda: [e for e in all_events(r, run_name, "stall")], 15, "a stall event")
        (stall,) = all_events(r, run_name, "stall")
        assert stall.fields["kind"] == "deadletters_rising" and stall.fields["value"] == 4
        port = json.loads(beat)["metrics_port"]
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'squall_stalls{kind="deadletters_rising"} 1.0' in text
        cleared = wait_for(lambda: all_events(r, run_name, "stall_cleared"), 15, "stall_cleared")
        assert cleared[0].fields["kind"] == "deadletters_rising" and cleared[0].fields["seconds"] > 0
    finally:
        procs.stop_all()

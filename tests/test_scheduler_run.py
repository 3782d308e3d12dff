"""The scheduler against a real Redis (and real runner processes where attempts must run)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time

import pytest
from runner_helpers import SQUALL, Procs, events, log_of, tasks, trajectories, write_jsonl
from waiting import wait_for

from squall.monitor.status import collect, render
from squall.scheduler.scheduler import Scheduler
from squall.shared import bus, schemas
from squall.shared.config import load_config
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = pytest.mark.redis


def reward_points(r, keys) -> list[schemas.RewardPoint]:
    """The reward curve as the scheduler wrote it (RewardPoint messages on `rewards`)."""
    return [schemas.decode(f[schemas.ENTRY_FIELD], schemas.RewardPoint) for _, f in r.xrange(keys.rewards)]


def make_config(redis_url, run, dataset, trainer=None, **scheduler):
    scheduler.setdefault("hold_until_trained", False)  # no trainer in these tests
    return load_config(
        env={},
        overrides={
            "run": {"name": run, "redis_url": redis_url},
            "scheduler": {"dataset": str(dataset), **scheduler},
            "trainer": trainer or {},
        },
    )


@pytest.fixture
def procs(redis_url, run_name, tmp_path):
    p = Procs(
        redis_url, run_name, tmp_path, SQUALL_RUNNER__LEASE_S="1", SQUALL_RUNNER__GRACE_S="1",
        SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false",
    )  # fmt: skip
    yield p
    p.stop_all()


def test_admission_bounds_inflight_groups_and_staleness(r, redis_url, run_name, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(50)])
    config = make_config(redis_url, run_name, data, group_size=3, max_inflight_groups=4, max_dispatch_lag=1)
    sched = Scheduler(config, r)
    while sched.dispatch_train(0):
        pass
    keys = Keys(run_name)
    assert r.hlen(keys.groups) == 4  # backpressure: no 5th group
    sent = tasks(r, run_name)
    assert len(sent) == 12 and {t.min_version for t in sent} == {0}
    assert sorted(t.task_id for t in sent) == sorted(f"{t.group_id}:{t.index}" for t in sent)
    assert Ledger(r, keys).counts() == {"dispatched": 12, "pending": 12}

    sched.cursor.max_inflight_groups = 10  # as a Control `limits` would
    assert not sched.dispatch_train(2)  # 2 - 0 > max_dispatch_lag: these groups would be too stale
    assert sched.dispatch_train(1)
    assert tasks(r, run_name)[-1].min_version == 1

    restarted = Scheduler(config, r)  # state and cursor come back from Redis
    assert restarted.cursor.samples == 5 and set(restarted.groups) == set(sched.groups)


def test_run_to_completion_with_epochs_and_ledger(r, redis_url, run_name, tmp_path, procs):
    rows = [{"id": f"s{i}", "reward": i % 2} for i in range(5)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
    sched = procs.start("scheduler", "--dataset", str(data), "--group-size", "2", "--epochs", "2")
    assert sched.wait(60) == 0
    keys = Keys(run_name)
    counts = Ledger(r, keys).counts()
    assert counts == {"dispatched": 20, "ok": 20}
    trajs = trajectories(r, run_name)
    assert len(trajs) == 20 and len({t.key for t in trajs}) == 20
    assert sorted(t.sample_id for t in trajs) == sorted([f"s{i}" for i in range(5)] * 4)
    assert all(t.reward == int(t.sample_id[1:]) % 2 for t in trajs)
    assert [e.fields["reason"] for e in events(r, run_name, "finished")] == ["dataset_exhausted"]
    points = reward_points(r, keys)
    assert len(points) == 10 and {p.mode for p in points} == {"train"}
    status = collect(r, run_name)
    assert status["ledger"]["balanced"] and status["open_groups"] == 0
    assert {(g["stream"], g["group"]): g["pending"] for g in status["groups"]}[
        ("trajectories", "scheduler")
    ] == 0
    assert status["runners_alive"] == 1 and [p["mode"] for p in status["recent_rewards"]] == ["train"] * 10
    cli = subprocess.run([*SQUALL, "status", "--run", run_name, "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert cli.returncode == 0 and "conservation OK" in cli.stdout and "dispatched=20" in cli.stdout, (
        cli.stderr
    )
    r.hincrby(keys.ledger, "ok", 1)  # break conservation: status must say so and exit 1
    cli = subprocess.run([*SQUALL, "status", "--json", "--run", run_name, "--redis-url", redis_url],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert cli.returncode == 1 and json.loads(cli.stdout)["ledger"]["balanced"] is False


@pytest.mark.slow
def test_failures_are_retried_per_member_then_deadlettered(r, redis_url, run_name, tmp_path, procs):
    rows = [{"id": b, "behave": b} for b in ("ok", "raise", "hang", "nan", "none", "emit")]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "6")
    sched = procs.start(
        "scheduler", "--dataset", str(data), "--group-size", "1",
        SQUALL_SCHEDULER__MAX_ATTEMPTS="2", SQUALL_SCHEDULER__TASK_TIMEOUT_S="1.5",
    )  # fmt: skip
    assert sched.wait(60) == 0
    by_sample: dict[str, list] = {}
    for t in trajectories(r, run_name):
        by_sample.setdefault(t.sample_id, []).append(t)
    assert [(t.status, t.reward) for t in by_sample["ok"]] == [("ok", 1.0)]
    # emit_reward attaches to the call it follows: this agent made none (turn_rewards.py)
    expected = {"raise": ("failed", "agent exploded"), "hang": ("timeout", "deadline"),
                "nan": ("failed", "reward is nan"), "none": ("failed", "no reward"),
                "emit": ("failed", "llm.emit_reward(0.5) before any model call")}  # fmt: skip
    for sample, (status, text) in expected.items():
        got = by_sample[sample]
        assert [t.attempt for t in got] == [0, 1], sample  # one retry, then no more
        assert all(t.status == status and t.reward is None and text in t.error for t in got), (sample, got)
    counts = Ledger(r, Keys(run_name)).counts()
    assert counts == {"dispatched": 11, "ok": 1, "retried": 5, "deadlettered": 5}
    dead = r.xrange(Keys(run_name).deadletter)
    assert len(dead) == 5 and all(b"in all 2 attempts" in f[b"reason"] for _, f in dead)


def test_validation_rounds_every_k_versions(r, redis_url, run_name, tmp_path, procs):
    rows = [{"id": i, "reward": 0.25 * (i % 4)} for i in range(8)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = make_config(
        redis_url, run_name, data, group_size=2, val_fraction=0.5, val_every=2, max_inflight_groups=1
    )
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
    sched = Scheduler(config, r)
    keys = Keys(run_name)
    expected_mean = sum(s.row["reward"] for s in sched.splits.val) / len(sched.splits.val)

    def val_points():
        sched.step()
        return [p for p in reward_points(r, keys) if p.mode == "val"]

    first = wait_for(val_points, 30, "the first validation round")
    assert first[0].version == 0 and first[0].mean == pytest.approx(expected_mean)
    r.hset(keys.versions, "trainer", 1)  # not yet: every 2 versions
    for _ in range(5):
        sched.step()
    assert len([p for p in reward_points(r, keys) if p.mode == "val"]) == 1
    r.hset(keys.versions, "trainer", 2)
    points = wait_for(lambda: len(val_points()) == 2 and val_points(), 30, "the second round")
    assert points[1].version == 2
    val_trajs = [t for t in trajectories(r, run_name) if t.mode == "val"]
    assert len(val_trajs) == 8 and all(Ledger(r, keys).state_of(t.key) == "validated" for t in val_trajs)
    while sched.step():
        pass
    assert Ledger(r, keys).balanced()


def finish_all_as_runner(r, run_name, reward=1.0):
    """Take every dispatched task and finish it ok, as a runner would (ledger included)."""
    keys = Keys(run_name)
    consumer = bus.GroupConsumer(
        r, keys.tasks, "runners", "me", kind=schemas.Task, deadletter_stream=keys.deadletter
    )
    done = []
    for d in consumer.read(100, 100):
        task = d.message
        traj = schemas.Trajectory(run=run_name, task_id=task.task_id, group_id=task.group_id, sample_id=task.sample_id,
                                  index=task.index, group_size=task.group_size, attempt=task.attempt,
                                  runner_id="me", status="ok", reward=reward)  # fmt: skip
        bus.publish(r, keys.trajectories, traj)
        consumer.ack([d.entry_id])
        Ledger(r, keys).move([task.key], "ok")
        done.append(task.key)
    return done


def test_rolled_out_groups_are_held_until_the_trainer_consumed_them(r, redis_url, run_name, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(6)])
    config = make_config(redis_url, run_name, data, group_size=2, max_inflight_groups=2, hold_until_trained=True,
                         trainer={"groups_per_step": 1},
                         poll_s=0.05, end_wait_s=1.0)  # fmt: skip
    sched = Scheduler(config, r)
    keys, ledger = Keys(run_name), Ledger(r, Keys(run_name))
    sched.step()
    first = finish_all_as_runner(r, run_name)
    assert len(first) == 4
    for _ in range(3):
        sched.step()
    assert r.xlen(keys.tasks) == 4  # rolled out, but the trainer has not consumed them: held
    assert all(g.rolled_out for g in sched.groups.values())
    ledger.move(first[:2], "trained")
    ledger.move(first[2:], "filtered:zero_variance")
    sched.step()
    assert r.xlen(keys.tasks) == 8 and len(sched.groups) == 2
    steps = 0
    while sched.step():  # the rest, the trainer consuming all but the last batch
        done = finish_all_as_runner(r, run_name)
        if r.xlen(keys.tasks) < 12:
            ledger.move(done, "trained")
        steps += 1
        assert steps < 500
    # No trainer ever answered the end of the data: the scheduler waited end_wait_s for one
    # (held groups are a trainer's to consume), then finished, still holding them.
    assert len(sched.groups) == 2 and all(g.rolled_out for g in sched.groups.values())
    (unconfirmed,) = events(r, run_name, "end_unconfirmed")
    assert "no answer from the trainer within end_wait_s=1" in unconfirmed.fields["reason"]
    assert unconfirmed.fields["waited_s"] >= 1.0
    assert [e.fields["reason"] for e in events(r, run_name, "finished")] == ["dataset_exhausted"]
    assert ledger.balanced()
    status = collect(r, run_name)  # shown as what they are: held, not open
    assert status["finished"] and status["open_groups"] == 2
    assert "held_groups=2 (rolled out, never consumed by a trainer)" in render(status)


def test_control_pause_resume_drain(r, redis_url, run_name, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(20)])
    config = make_config(redis_url, run_name, data, group_size=1, max_inflight_groups=2, poll_s=0.05)
    sched = Scheduler(config, r)
    keys = Keys(run_name)

    def control(action, **limits):
        bus.publish(r, keys.control, schemas.Control(run=run_name, action=action, limits=limits))

    control("pause")
    sched.step()
    assert r.xlen(keys.tasks) == 0
    control("resume")
    control("limits", max_inflight_groups=3)
    sched.step()
    assert r.xlen(keys.tasks) == 3
    control("drain")
    # A runner of our own: take and finish everything dispatched so far.
    consumer = bus.GroupConsumer(
        r, keys.tasks, "runners", "me", kind=schemas.Task, deadletter_stream=keys.deadletter
    )
    for d in consumer.read(10, 100):
        task = d.message
        traj = schemas.Trajectory(run=run_name, task_id=task.task_id, group_id=task.group_id, sample_id=task.sample_id,
                                  index=task.index, group_size=task.group_size, attempt=task.attempt,
                                  runner_id="me", status="ok", reward=1.0)  # fmt: skip
        bus.publish(r, keys.trajectories, traj)
        consumer.ack([d.entry_id])
        Ledger(r, keys).move([task.key], "ok")
    steps = 0
    while sched.step():
        steps += 1
        assert steps < 100
    assert r.xlen(keys.tasks) == 3  # drained: nothing new went out
    assert [e.fields["reason"] for e in events(r, run_name, "finished")] == ["drained"]
    assert Scheduler(config, r).cursor.draining == 1  # a restart stays drained


@pytest.mark.slow
def test_scheduler_killed_and_restarted_neither_loses_nor_duplicates(r, redis_url, run_name, tmp_path, procs):
    rows = [{"id": f"s{i}", "sleep": 0.2} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "8")
    args = ("--dataset", str(data), "--group-size", "3")
    env = {"SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "3"}
    rng = random.Random(0)
    keys = Keys(run_name)
    kills, rc = 0, None

    def recorded() -> int:
        return sum(Ledger(r, keys).counts().values())

    # Each life is killed 0-0.4 s after it has dispatched something of its own (a fixed clock
    # would, on a loaded machine, kill it during start-up every time and test nothing), three
    # times; the fourth life runs to the end.
    while kills < 3:
        before = recorded()
        sched = procs.start("scheduler", *args, **env)
        wait_for(
            lambda before=before, sched=sched: recorded() > before or sched.poll() is not None,
            60,
            "the scheduler dispatching",
        )
        if sched.poll() is not None:
            break  # it finished the run within this life
        time.sleep(rng.uniform(0.0, 0.4))
        sched.send_signal(signal.SIGKILL)
        sched.wait(5)
        kills += 1
    else:
        sched = procs.start("scheduler", *args, **env)
    rc = sched.wait(120)
    assert rc == 0 and kills >= 2
    sent = tasks(r, run_name)
    assert len(sent) == 120 and len({t.key for t in sent}) == 120  # nothing dispatched twice
    assert sorted({t.sample_id for t in sent}) == sorted(f"s{i}" for i in range(40))
    time.sleep(0.2)
    trajs = trajectories(r, run_name)
    assert len(trajs) == 120 and len({t.key for t in trajs}) == 120
    assert Ledger(r, keys).counts() == {"dispatched": 120, "ok": 120}
    assert r.xpending(keys.trajectories, "scheduler")["pending"] == 0


@pytest.mark.slow
def test_scheduler_sigterm_exits_0_and_a_restart_finishes_the_run(r, redis_url, run_name, tmp_path, procs):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "sleep": 0.2} for i in range(8)])
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
    args = ("--dataset", str(data), "--group-size", "2")
    env = {"SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "2"}
    sched = procs.start("scheduler", *args, **env)
    wait_for(lambda: len(trajectories(r, run_name)) >= 2, 30, "some trajectories")
    sched.send_signal(signal.SIGTERM)
    assert sched.wait(10) == 0
    assert len(events(r, run_name, "stopped")) == 1 and not events(r, run_name, "finished")
    assert procs.start("scheduler", *args, **env).wait(60) == 0
    assert Ledger(r, Keys(run_name)).counts() == {"dispatched": 16, "ok": 16}


@pytest.mark.slow
def test_standby_takes_over_from_a_dead_or_paused_leader_without_double_dispatch(
    r, redis_url, run_name, tmp_path, procs
):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "sleep": 0.2} for i in range(16)])
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
    args = ("--dataset", str(data), "--group-size", "2")
    env = {"SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "2", "SQUALL_SCHEDULER__STANDBY_AFTER_S": "2",
           "SQUALL_RUN__LOG_LEVEL": "INFO"}  # fmt: skip
    keys = Keys(run_name)
    first = procs.start("scheduler", *args, **env)
    wait_for(lambda: len(trajectories(r, run_name)) >= 2, 30, "the first leader at work")
    second = procs.start("scheduler", *args, **env)
    wait_for(lambda: "scheduler_standby" in log_of(second), 20, "the second one to stand by")
    first.send_signal(signal.SIGSTOP)  # paused, not dead: its heartbeat goes stale
    try:
        wait_for(lambda: "scheduler_leading" in log_of(second), 20, "the standby to take the lead")
    finally:
        first.send_signal(signal.SIGCONT)  # wakes up, sees the newer leader epoch, stands by
    wait_for(lambda: "scheduler_lost_lead" in log_of(first), 20, "the old leader to step down")
    assert second.wait(60) == 0 and first.wait(30) == 0  # the old one exits once the run is finished
    sent = tasks(r, run_name)
    assert len(sent) == 32 and len({t.key for t in sent}) == 32
    assert Ledger(r, keys).counts() == {"dispatched": 32, "ok": 32}
    assert len(events(r, run_name, "finished")) == 1


def test_held_groups_older_than_max_staleness_do_not_block_dispatch(r, redis_url, run_name, tmp_path):
    # Regression: a rolled-out group held for the trainer (which needs one more step's worth of
    # groups) used to count as "oldest in flight", so once the trainer moved on no group could
    # be dispatched and the trainer never got the groups its step waited for: a deadlock.
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(10)])
    config = make_config(redis_url, run_name, data, group_size=2, max_inflight_groups=4, max_dispatch_lag=1,
                         hold_until_trained=True, trainer={"groups_per_step": 2}, poll_s=0.05)  # fmt: skip
    sched = Scheduler(config, r)
    assert sched.dispatch_train(0)
    assert len(finish_all_as_runner(r, run_name)) == 2
    for delivery in sched.consumer.read(count=10, block_ms=1000):  # the outcomes, as step() reads them
        sched.handle(delivery)
    (held,) = sched.groups.values()
    assert held.rolled_out and held.version == 0
    assert sched.dispatch_train(5)  # the trainer moved on to version 5 meanwhile
    fresh = [g for g in sched.groups.values() if g is not held]
    assert fresh and all(g.version == 5 for g in fresh)

"""The scheduler of a run with two trained roles, on a real Redis: each role's version is
recorded per group and bounds dispatch on its own (max_dispatch_lag per role), and each role's
own rewards become its train and validation reward points, shown by `squall status`."""

from __future__ import annotations

import pytest
from runner_helpers import write_jsonl
from test_scheduler_run import make_config, reward_points

from squall.monitor.status import collect, render
from squall.scheduler.scheduler import Scheduler
from squall.shared import bus, schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = pytest.mark.redis

ROLES = {"wolves": {"agents": ["wolf"]}, "villagers": {"agents": ["vil"]}}


def roles_config(redis_url, run, data, **scheduler):
    config = make_config(redis_url, run, data, **scheduler)
    return config.model_validate({**config.model_dump(), "roles": ROLES})


def finish_all(r, run_name, villagers_win):
    """Every dispatched task finished ok with a reward table, as a runner would."""
    keys = Keys(run_name)
    consumer = bus.GroupConsumer(
        r, keys.tasks, "runners", "me", kind=schemas.Task, deadletter_stream=keys.deadletter
    )
    for d in consumer.read(100, 100):
        task = d.message
        won = villagers_win(task)
        traj = schemas.Trajectory(run=run_name, task_id=task.task_id, group_id=task.group_id, sample_id=task.sample_id,
                                  index=task.index, group_size=task.group_size, attempt=task.attempt, mode=task.mode,
                                  runner_id="me", status="ok", reward=0.5,
                                  role_rewards={"villagers": won, "wolves": 1.0 - won})  # fmt: skip
        bus.publish(r, keys.trajectories, traj)
        consumer.ack([d.entry_id])
        Ledger(r, keys).move([task.key], "ok")


def test_dispatch_lag_and_reward_points_per_role(r, redis_url, run_name, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(40)])
    config = roles_config(redis_url, run_name, data, group_size=2, max_inflight_groups=8, max_dispatch_lag=1,
                          val_fraction=0.1, val_every=1)  # fmt: skip
    keys = Keys(run_name)
    r.hset(keys.versions, mapping={"trainer:wolves": 3, "trainer:villagers": 0})
    sched = Scheduler(config, r)
    assert sched.trainer_version() == 0  # the lowest role's: a task's min_version holds for every role
    assert sched.dispatch_train(0)
    (group,) = [g for g in sched.groups.values() if g.mode == "train"]
    assert group.role_versions == {"wolves": 3, "villagers": 0}
    r.hset(keys.versions, "trainer:villagers", 2)  # the villagers moved 2 past that group: too stale
    assert not sched.dispatch_train(0)
    r.hset(keys.versions, mapping={"trainer:villagers": 1, "trainer:wolves": 4})  # each 1 ahead: fine
    assert sched.dispatch_train(1)

    r.hset(keys.versions, mapping={"trainer:villagers": 0, "trainer:wolves": 0})
    for _ in range(4):
        sched.step()
        finish_all(r, run_name, lambda task: float(task.index == 0))  # member 0 of each group: villagers win
    for _ in range(4):
        sched.step()
    points = reward_points(r, keys)
    for role, expected in (("villagers", 0.5), ("wolves", 0.5)):
        train = [p for p in points if p.role == role and p.mode == "train"]
        assert train and all(p.mean == pytest.approx(expected) and p.count == 2 for p in train)
    val = {p.role: p for p in points if p.mode == "val"}
    assert set(val) == {"", "villagers", "wolves"}  # the attempts' mean and each role's own
    assert val["villagers"].count == val["wolves"].count == val[""].count
    assert val["villagers"].mean + val["wolves"].mean == pytest.approx(1.0)
    assert val[""].mean == pytest.approx(0.5)

    status = collect(r, run_name, rewards=1000)
    assert status["rewards"]["val"][0]["mean"] == pytest.approx(0.5)  # role points kept apart
    lines = [line for line in render(status).splitlines() if line.startswith("role ")]
    assert len(lines) == 2 and all("val=" in line and "train=0.500" in line for line in lines), lines

    from squall.local.progress import plot_curve, role_summaries, snapshot

    summary = role_summaries(snapshot(r, keys))  # what `squall up` writes to summary.json's `roles`
    assert set(summary) == {"villagers", "wolves"}
    assert summary["villagers"]["val_reward_start"] == pytest.approx(val["villagers"].mean)
    assert summary["wolves"]["val_reward_end"] == pytest.approx(val["wolves"].mean)
    assert len(summary["wolves"]["train_curve"]) == len(
        [p for p in points if p.role == "wolves" and p.mode == "train"]
    )
    png = plot_curve(snapshot(r, keys), tmp_path / "curve.png")
    assert png is not None and png.stat().st_size > 1000

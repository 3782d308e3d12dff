"""An attempt deadline that does not count queue time (scheduler.attempt_timeout_s, carried as
Task.run_timeout_s): a real runner process with one slot works through a queue of attempts on a
real Redis. Counted from dispatch, the last ones time out while they wait for the slot; counted
from their start, all finish, and one that hangs still times out after its own time."""

from __future__ import annotations

import time

import pytest
from runner_helpers import Procs, trajectories
from waiting import wait_for

from squall.shared import bus, schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = pytest.mark.redis


def queue(r, run: str, rows: list[dict], *, deadline_s: float, run_timeout_s: float) -> list[schemas.Task]:
    """Single-member tasks as the scheduler dispatches them (ledger `pending`)."""
    keys = Keys(run)
    bus.ensure_group(r, keys.tasks, "runners")
    sent = []
    for i, row in enumerate(rows):
        task = schemas.Task(run=run, task_id=f"q{i}:0", group_id=f"q{i}", sample_id=str(i), index=0,
                            group_size=1, payload=row, deadline=time.time() + deadline_s,
                            run_timeout_s=run_timeout_s)  # fmt: skip
        bus.publish(r, keys.tasks, task)
        Ledger(r, keys).move([task.key], "pending", allowed_from=("new",))
        sent.append(task)
    return sent


@pytest.mark.parametrize("from_start", [False, True])
def test_queue_time_counts_only_without_an_attempt_timeout(r, redis_url, run_name, tmp_path, from_start):
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__HEARTBEAT_S="0.2", SQUALL_RUNNER__GRACE_S="1")
    try:
        procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "1")
        wait_for(lambda: r.hlen(Keys(run_name).heartbeats), 30, "the runner's first heartbeat")
        # four 0.8 s attempts through one slot: the last starts ~2.4 s after dispatch
        rows = [{"sleep": 0.8, "reward": 1}] * 4
        if from_start:  # 1.5 s each from its start; dispatch only bounds the queueing (30 s)
            sent = queue(r, run_name, [*rows, {"behave": "hang"}], deadline_s=30.0, run_timeout_s=1.5)
        else:  # 1.5 s from dispatch, as task_timeout_s alone does
            sent = queue(r, run_name, rows, deadline_s=1.5, run_timeout_s=0.0)
        wait_for(lambda: len(trajectories(r, run_name)) >= len(sent), 40, "every attempt settled")
        status = {t.task_id: t.status for t in trajectories(r, run_name)}
        if from_start:
            assert [status[t.task_id] for t in sent] == ["ok"] * 4 + ["timeout"]
        else:
            assert status[sent[0].task_id] == "ok" and status[sent[-1].task_id] == "timeout"
            late = next(t for t in trajectories(r, run_name) if t.task_id == sent[-1].task_id)
            assert "waited in the queue" in (late.error or "")
    finally:
        procs.stop_all()


def test_a_negative_run_timeout_is_refused_by_name():
    task = schemas.Task(run="r", task_id="a:0", group_id="a", sample_id="a", index=0, group_size=1,
                        payload={}, deadline=time.time() + 5, run_timeout_s=-1.0)  # fmt: skip
    with pytest.raises(schemas.SchemaError, match="run_timeout_s"):
        task.validate()

"""Runner processes against a real Redis: kills, reclaims, SIGTERM, malformed tasks, commands."""

from __future__ import annotations

import json
import signal
import sys
import time

import httpx
import pytest
import redis
from runner_helpers import Procs, dispatch, log_of, trajectories
from waiting import wait_for

from squall.shared import bus, schemas
from squall.shared.heartbeat import state_of
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import LocalRedis

pytestmark = pytest.mark.redis


@pytest.fixture
def procs(redis_url, run_name, tmp_path):
    p = Procs(
        redis_url,
        run_name,
        tmp_path,
        SQUALL_RUNNER__LEASE_S="1",
        SQUALL_RUNNER__HEARTBEAT_S="0.2",
        SQUALL_RUNNER__GRACE_S="1",
    )
    yield p
    p.stop_all()


def settled(r, run, n):
    return lambda: len(trajectories(r, run)) >= n


@pytest.mark.slow
def test_runner_killed_mid_attempt_is_reclaimed_and_finished_once(r, run_name, procs):
    keys = Keys(run_name)
    sent = dispatch(r, run_name, [{"sleep": 2.5, "reward": 1}] * 3 + [{"reward": 1}] * 3)
    doomed = procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "3")
    wait_for(lambda: Ledger(r, keys).counts().get("running", 0) == 3, 20, "three attempts running")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(5)
    survivor = procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "3")
    wait_for(settled(r, run_name, 6), 30, "every attempt to finish")
    time.sleep(0.5)  # anything extra would show up now
    trajs = trajectories(r, run_name)
    assert sorted(t.key for t in trajs) == sorted(t.key for t in sent)  # none lost, none twice
    assert all(t.status == "ok" for t in trajs)
    assert len({t.runner_id for t in trajs}) == 1  # the survivor ran them all
    assert Ledger(r, keys).counts() == {"dispatched": 6, "ok": 6}
    assert r.xpending(keys.tasks, "runners")["pending"] == 0
    beats = [json.loads(v) for v in r.hvals(keys.heartbeats)]
    wait_for(lambda: sum(json.loads(v)["reclaimed"] for v in r.hvals(keys.heartbeats)) == 3, 5, "3 reclaims")
    assert survivor.poll() is None and beats


def test_malformed_task_goes_to_deadletter_and_runner_keeps_serving(r, run_name, procs):
    keys = Keys(run_name)
    r.xadd(keys.tasks, {"m": b"\x93garbage"})
    r.xadd(keys.tasks, {"other": b"field"})
    dispatch(r, run_name, [{"reward": 0.25}])
    procs.start("runner", "--agent", "runner_agents:trivial")
    wait_for(settled(r, run_name, 1), 20, "the good task")
    dead = [f for _, f in r.xrange(keys.deadletter)]
    assert len(dead) == 2 and all(f[b"source"] == keys.tasks.encode() for f in dead)
    assert trajectories(r, run_name)[0].reward == 0.25
    assert r.xpending(keys.tasks, "runners")["pending"] == 0
    (beat,) = [json.loads(v) for v in r.hvals(keys.heartbeats)]
    metrics = httpx.get(f"http://127.0.0.1:{beat['metrics_port']}/metrics", timeout=5).text
    assert 'squall_attempts_total{status="ok"} 1.0' in metrics
    assert 'squall_deadlettered_total{source="tasks"} 2.0' in metrics


@pytest.mark.slow
def test_sigterm_finishes_short_attempts_and_hands_back_long_ones(r, run_name, procs):
    keys = Keys(run_name)
    dispatch(r, run_name, [{"sleep": 0.3, "reward": 1}, {"sleep": 30, "reward": 1}])
    runner = procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "2",
                         SQUALL_RUNNER__GRACE_S="1.5", SQUALL_RUNNER__LEASE_S="60")  # fmt: skip
    wait_for(lambda: Ledger(r, keys).counts().get("running", 0) == 2, 20, "both attempts running")
    runner.send_signal(signal.SIGTERM)
    assert runner.wait(15) == 0
    trajs = trajectories(r, run_name)
    assert [t.task_id for t in trajs] == ["g0:0"]  # the short one finished within the grace period
    pending = r.xpending_range(keys.tasks, "runners", "-", "+", 10)
    assert len(pending) == 1 and pending[0]["time_since_delivered"] >= 60_000  # handed back: reclaimable now
    # A stopped runner marks its heartbeat stopped (not alive, not dead), nothing in hand.
    ((field, raw),) = r.hgetall(keys.heartbeats).items()
    beat = schemas.decode_heartbeat(field, raw, run_name)
    assert beat.stopped > 0 and beat.stats["busy"] == 0 and state_of(beat) == "stopped"


def test_delivery_limit_gives_up_with_a_failed_trajectory(r, run_name, procs):
    keys = Keys(run_name)
    dispatch(r, run_name, [{"reward": 1}])
    # A consumer that took the task and died (never acks): its lease lapses.
    r.xreadgroup("runners", "dead-runner", {keys.tasks: ">"}, count=1)
    procs.start("runner", "--agent", "runner_agents:trivial", SQUALL_RUNNER__MAX_DELIVERIES="1")
    wait_for(settled(r, run_name, 1), 20, "the given-up attempt")
    (traj,) = trajectories(r, run_name)
    assert traj.status == "failed" and "delivered 2 times" in traj.error
    assert Ledger(r, keys).counts() == {"dispatched": 1, "failed": 1}


def test_command_agent_reward_timeout_and_bad_output(r, run_name, tmp_path, procs):
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, sys, time\n"
        "task = json.load(sys.stdin)\n"
        "assert os.environ['OPENAI_BASE_URL'].endswith('/v1') and os.environ['OPENAI_API_KEY']\n"
        "if task.get('hang'): time.sleep(60)\n"
        "print('some log line')\n"
        "print(task['out'])\n"
    )
    rows = [{"out": "0.75"}, {"out": "not-a-number"}, {"out": "1", "hang": True}]
    sent = dispatch(r, run_name, rows[:2]) + dispatch_with_deadline(r, run_name, rows[2], 1.5)
    procs.start("runner", "--agent-cmd", f"{sys.executable} {script}", "--concurrency", "3")
    wait_for(settled(r, run_name, 3), 30, "three command attempts")
    by_id = {t.task_id: t for t in trajectories(r, run_name)}
    assert by_id[sent[0].task_id].reward == 0.75
    assert by_id[sent[1].task_id].status == "failed" and "must be the reward" in by_id[sent[1].task_id].error
    assert by_id[sent[2].task_id].status == "timeout"


def test_command_agent_gets_no_squall_settings_in_its_environment(r, redis_url, run_name, tmp_path, procs):
    """The Redis URL (with its password) and API keys live in SQUALL_* variables: an agent
    command, possibly running model-written code, must not inherit them."""
    script = tmp_path / "env_agent.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.load(sys.stdin)\n"
        "open(task['report'], 'w').write(json.dumps(dict(os.environ)))\n"
        "print(0.0 if 'SQUALL_RUN__REDIS_URL' in os.environ else 1.0)\n"
    )
    report = tmp_path / "env.json"
    sent = dispatch(r, run_name, [{"report": str(report)}])
    procs.start(
        "runner", "--agent-cmd", f"{sys.executable} {script}",
        SQUALL_RUN__REDIS_URL=redis_url, SQUALL_RUNNER__CONCURRENCY="1", AGENT_OWN_SETTING="kept",
    )  # fmt: skip
    wait_for(settled(r, run_name, 1), 30, "the command attempt")
    (traj,) = trajectories(r, run_name)
    assert traj.task_id == sent[0].task_id and traj.status == "ok", traj.error
    env = json.loads(report.read_text())
    assert traj.reward == 1.0 and not [name for name in env if name.upper().startswith("SQUALL_")]
    assert env["AGENT_OWN_SETTING"] == "kept" and env["PATH"]  # the rest of the environment stays
    assert env["OPENAI_BASE_URL"].endswith("/v1") and "OPENAI_API_KEY" in env


def dispatch_with_deadline(r, run, row, deadline_s):
    keys = Keys(run)
    bus.ensure_group(r, keys.tasks, "runners")
    task = schemas.Task(run=run, task_id="h:0", group_id="h", sample_id="h", index=0, group_size=1,
                        payload=row, deadline=time.time() + deadline_s)  # fmt: skip
    bus.publish(r, keys.tasks, task)
    Ledger(r, keys).move([task.key], "pending", allowed_from=("new",))
    return [task]


def test_reward_fn_from_config_scores_the_final_answer(r, run_name, procs, tmp_path):
    dispatch(r, run_name, [{"behave": "none"}])
    procs.start("runner", "--agent", "runner_agents:trivial", "--reward-fn", "runner_agents:answer_reward")
    wait_for(settled(r, run_name, 1), 20, "the attempt")
    (traj,) = trajectories(r, run_name)
    assert (traj.status, traj.reward) == ("ok", 0.0)  # no LLM call, so no final answer: 0 from reward_fn


@pytest.mark.slow
def test_runner_rides_through_a_redis_restart_and_finishes_each_attempt_once(run_name, tmp_path):
    """Redis (AOF on) stops while attempts run and comes back longer than a lease later: the
    attempts finish, each published once, and the outage is logged and counted once."""
    server = LocalRedis(data_dir=tmp_path / "redis", aof=True).start()
    procs = Procs(server.url, run_name, tmp_path, SQUALL_RUNNER__LEASE_S="1", SQUALL_RUNNER__HEARTBEAT_S="0.2",
                  SQUALL_RUN__LOG_LEVEL="INFO")  # fmt: skip
    try:
        r = redis.Redis.from_url(server.url)
        keys = Keys(run_name)
        sent = dispatch(r, run_name, [{"sleep": 3, "reward": 1}] * 2)
        runner = procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "2")
        wait_for(lambda: Ledger(r, keys).counts().get("running", 0) == 2, 20, "both attempts running")
        server.close()
        time.sleep(1.5)  # longer than the lease: the runner's own reclaim finds its entries again
        server = LocalRedis(port=server.port, data_dir=tmp_path / "redis", aof=True).start()
        r = redis.Redis.from_url(server.url)
        wait_for(settled(r, run_name, 2), 30, "both attempts published")
        time.sleep(0.5)  # a second trajectory would show up now
        trajs = trajectories(r, run_name)
        assert sorted(t.key for t in trajs) == sorted(t.key for t in sent) and all(
            t.status == "ok" for t in trajs
        )
        assert Ledger(r, keys).counts() == {"dispatched": 2, "ok": 2}
        assert r.xpending(keys.tasks, "runners")["pending"] == 0 and runner.poll() is None
        (beat,) = [json.loads(v) for v in r.hvals(keys.heartbeats)]
        metrics = httpx.get(f"http://127.0.0.1:{beat['metrics_port']}/metrics", timeout=5).text
        assert 'squall_errors_total{kind="redis_outage"} 1.0' in metrics
        log = log_of(runner)
        assert log.count('"redis_outage"') == 1 and '"redis_back"' in log
    finally:
        procs.stop_all()
        server.close()


def test_runner_exits_non_zero_naming_the_url_when_redis_stays_away(run_name, tmp_path):
    server = LocalRedis(data_dir=tmp_path / "redis").start()
    procs = Procs(server.url, run_name, tmp_path, SQUALL_RUN__REDIS_OUTAGE_S="1.5")
    try:
        r = redis.Redis.from_url(server.url)
        dispatch(r, run_name, [{"sleep": 30, "reward": 1}])
        runner = procs.start("runner", "--agent", "runner_agents:trivial")
        wait_for(lambda: Ledger(r, Keys(run_name)).counts().get("running", 0) == 1, 20, "the attempt running")
        server.close()
        assert runner.wait(20) == 1
        log = log_of(runner)
        assert "redis_unavailable" in log and f"127.0.0.1:{server.port}" in log and "did not come back" in log
    finally:
        procs.stop_all()
        server.close()

"""Faults that used to cost data or stall a run (issue 21), each against real parts: a real
Redis, real inference nodes on the tiny model, the real gateway, scheduler and runner processes.

- a node's version is what it serves: catch-up past malformed `weights` entries, `versions`
  rewritten on start, the gateway never serving a task below its min_version;
- an attempt that failed because no policy node answered is retried for free (within the
  group's budget) and never gives a member up;
- a standby that finds the run finished marks its heartbeat stopped; a validation round's
  reward point lands in the transaction that closes the round.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import redis
import torch
from inference_helpers import free_port, perturbed_versions, weight_errors
from runner_helpers import Procs, log_of, tasks, trajectories, write_jsonl
from test_inference_reload import MESSAGES, publish, start_node, write_weights
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.monitor.status import collect, render
from squall.runner.gateway import Gateway
from squall.scheduler.outcomes import InfraBudget, Outcome, decide_outcome
from squall.shared import schemas, weightstream
from squall.shared.config import RunnerSection, load_config
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

torch.set_num_threads(1)
pytestmark = pytest.mark.redis

GARBAGE = [
    {schemas.ENTRY_FIELD: b"\xc1 not msgpack"},
    {b"other": b"no m field"},
    {schemas.ENTRY_FIELD: schemas.encode(schemas.Event(run="x", service="x", name="not a WeightVersion"))},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny_dir):
    return perturbed_versions(tiny_dir)


def served(node) -> int:
    return int(httpx.get(f"{node.url}/health").json()["weight_version"])


# --- the newest valid version ---------------------------------------------------------------
def test_newest_valid_walks_back_past_any_number_of_malformed_entries(r, run_name):
    keys = Keys(run_name)
    assert weightstream.newest_valid(r, keys.weights, "test") == weightstream.NewestWeights(None, None, 0)
    publish(r, run_name, 7, "/w7", "ab")
    for i in range(weightstream.SCAN_PAGE * 2 + 3):  # more than two pages of garbage on top
        r.xadd(keys.weights, GARBAGE[i % len(GARBAGE)])
    found = weightstream.newest_valid(r, keys.weights, "test")
    newest_id = r.xrevrange(keys.weights, count=1)[0][0].decode()
    assert found.version is not None and found.version.version == 7
    assert (found.last_id, found.skipped) == (newest_id, weightstream.SCAN_PAGE * 2 + 3)
    r.delete(keys.weights)
    r.xadd(keys.weights, GARBAGE[0])
    only_garbage = weightstream.newest_valid(r, keys.weights, "test")
    assert only_garbage.version is None and only_garbage.skipped == 1 and only_garbage.last_id


def test_a_restarted_node_serves_the_newest_valid_version_and_says_so(
    tiny_dir, models, r, redis_url, run_name, tmp_path
):
    """Issue 21 #1 and #2: malformed newest entries and a stale `versions` field left by the
    node's previous life; the node loads version 1, skipping 3 entries, and `versions` says 1."""
    keys = Keys(run_name)
    location, checksum = write_weights(tmp_path, 1, models[1])
    publish(r, run_name, 1, location, checksum)
    for fields in GARBAGE:
        r.xadd(keys.weights, fields)
    r.hset(keys.versions, "inference:n1", 35)  # what the node acknowledged before it died
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        assert served(node) == 1
        assert r.hget(keys.versions, "inference:n1") == b"1"
        assert weight_errors(node).get("message") == len(GARBAGE)
        location2, checksum2 = write_weights(tmp_path, 2, models[0])
        publish(r, run_name, 2, location2, checksum2)  # it follows on after the garbage
        wait_for(lambda: served(node) == 2, 30, "version 2 loaded")
        wait_for(lambda: r.hget(keys.versions, "inference:n1") == b"2", 10, "versions to say 2")
    finally:
        node.stop()


def test_a_node_with_no_valid_version_overwrites_a_stale_acknowledgement(tiny_dir, r, redis_url, run_name):
    keys = Keys(run_name)
    r.xadd(keys.weights, GARBAGE[0])
    r.hset(keys.versions, "inference:n1", 35)
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        assert served(node) == 0 and r.hget(keys.versions, "inference:n1") == b"0"
    finally:
        node.stop()


# --- the gateway and min_version --------------------------------------------------------------
async def _call(gateway: Gateway, min_version: int) -> tuple[httpx.Response, object]:
    attempt = gateway.open(f"g1:0#{min_version}", min_version)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.post(f"{gateway.base_url(attempt.token)}/chat/completions",
                                      json={"model": "policy", "messages": MESSAGES, "max_tokens": 3})  # fmt: skip
        return reply, attempt
    finally:
        gateway.close(attempt.token)


async def _with_gateway(section: RunnerSection, body):
    gateway = Gateway(section, "policy")
    await gateway.start()
    try:
        return await body(gateway)
    finally:
        await gateway.stop()


def test_the_gateway_never_serves_a_task_from_a_node_below_its_min_version(
    tiny_dir, models, r, redis_url, run_name, tmp_path
):
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        impatient = RunnerSection(inference_urls=[node.url], behind_wait_s=1.0, upstream_retries=2)
        refused, attempt = asyncio.run(_with_gateway(impatient, lambda gw: _call(gw, 1)))
        assert refused.status_code == 502 and "version" in refused.json()["error"]["message"]
        assert attempt.infra == "behind" and attempt.turns == []  # no version-0 turn recorded

        location, checksum = write_weights(tmp_path, 1, models[1])
        later = threading.Timer(1.0, publish, (r, run_name, 1, location, checksum))
        later.start()  # the node catches up while the call waits for it
        patient = RunnerSection(inference_urls=[node.url], behind_wait_s=30.0)
        started = time.monotonic()
        answered, attempt = asyncio.run(_with_gateway(patient, lambda gw: _call(gw, 1)))
        later.join()
        assert answered.status_code == 200, answered.text
        assert [t.version for t in attempt.turns] == [1] and attempt.infra == ""
        assert time.monotonic() - started >= 0.9  # it did wait
    finally:
        node.stop()


def test_a_policy_node_that_does_not_answer_is_an_infrastructure_failure():
    down = f"http://127.0.0.1:{free_port()}"
    section = RunnerSection(inference_urls=[down], upstream_retries=1)
    refused, attempt = asyncio.run(_with_gateway(section, lambda gw: _call(gw, 0)))
    assert refused.status_code == 502 and attempt.infra == "connection"


# --- infrastructure outcomes ------------------------------------------------------------------
def _group(size: int = 2, infra: list[int] | None = None, since: float = 0.0, attempts=None):
    from squall.scheduler.groups import Group

    return Group(group_id="g1", sample_id="s", mode="train", version=0, size=size, epoch=0, created=0.0,
                 payload={}, attempts=attempts or [0] * size, done=[False] * size, rewards=[None] * size,
                 infra=infra or [], infra_since=since)  # fmt: skip


def _traj(index: int, attempt: int, infra: str = "", status: str = "failed") -> schemas.Trajectory:
    return schemas.Trajectory(run="x", task_id=f"g1:{index}", group_id="g1", sample_id="s", index=index,
                              group_size=2, attempt=attempt, runner_id="r", status=status, infra=infra,
                              reward=1.0 if status == "ok" else None)  # fmt: skip


def test_infrastructure_failures_are_free_within_the_budget_and_charged_after():
    budget = InfraBudget(retries=3, window_s=60.0)
    free = decide_outcome(_group(), _traj(0, 0, "connection"), 1, budget, now=10.0)
    assert free is Outcome.RETRY_INFRA  # max_attempts 1 would have given it up
    assert decide_outcome(_group(), _traj(0, 0, ""), 1, budget) is Outcome.GIVE_UP  # the agent's own
    # attempt 3 of member 0 (its 4th try), 2 of the 3 before it free: this failure is its 2nd charged
    g = _group(infra=[2, 1], since=5.0, attempts=[3, 0])
    assert decide_outcome(g, _traj(0, 3, "http"), 3, budget, now=10.0) is Outcome.RETRY  # budget spent
    assert decide_outcome(g, _traj(0, 3, "http"), 2, budget, now=10.0) is Outcome.GIVE_UP
    g = _group(infra=[2, 0], since=5.0, attempts=[3, 0])
    assert decide_outcome(g, _traj(0, 3, "http"), 2, budget, now=10.0) is Outcome.RETRY_INFRA
    assert decide_outcome(g, _traj(0, 3, "http"), 3, budget, now=70.0) is Outcome.RETRY  # past the window
    g = _group(infra=[3, 0], since=5.0, attempts=[4, 0])
    assert decide_outcome(g, _traj(0, 4, "behind"), 1, budget, now=10.0) is Outcome.GIVE_UP
    assert decide_outcome(g, _traj(0, 4, "behind"), 3, None) is Outcome.RETRY  # no budget: all charged


@pytest.fixture
def procs(redis_url, run_name, tmp_path):
    p = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__LEASE_S="2", SQUALL_RUNNER__GRACE_S="1",
              SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false", SQUALL_RUNNER__UPSTREAM_RETRIES="1",
              SQUALL_SCHEDULER__INFRA_BACKOFF_S="0.3", SQUALL_SCHEDULER__INFRA_BACKOFF_MAX_S="1")  # fmt: skip
    yield p
    p.stop_all()


def infra_counts(r, run_name) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(Keys(run_name).infra).items()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_inference_outage_gives_no_member_up(tiny_dir, r, redis_url, run_name, tmp_path, procs):
    """No node at all for the first seconds, then one comes up: with max_attempts 1 every
    member still ends ok, each failure retried for free after a backoff and counted."""
    port = free_port()
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(4)])
    procs.start("runner", "--agent", "gateway_agents:needs_inference", "--concurrency", "4",
                "--inference-url", f"http://127.0.0.1:{port}")  # fmt: skip
    sched = procs.start("scheduler", "--dataset", str(data), "--group-size", "2",
                        SQUALL_SCHEDULER__MAX_ATTEMPTS="1")  # fmt: skip
    wait_for(
        lambda: infra_counts(r, run_name).get("retried:connection", 0) >= 8, 60, "infrastructure retries"
    )
    procs.start("inference", "--model", str(tiny_dir), "--port", str(port), "--node", "n1")
    assert sched.wait(180) == 0, log_of(sched)[-3000:]
    counts = Ledger(r, Keys(run_name)).counts()
    retried = infra_counts(r, run_name)["retried:connection"]
    assert counts == {"dispatched": 8 + retried, "ok": 8, "retried": retried}, counts
    assert set(infra_counts(r, run_name)) == {"retried:connection"}  # none charged, none given up
    shown = render(collect(r, run_name)).splitlines()
    assert f"infra      retried:connection={retried}" in shown, shown
    failed = [t for t in trajectories(r, run_name) if t.status != "ok"]
    assert len(failed) == retried and all(t.infra == "connection" for t in failed)
    backed_off = [t for t in tasks(r, run_name) if t.attempt > 0]
    assert backed_off and all(t.not_before > t.created_at for t in backed_off)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_infrastructure_budget_is_bounded_per_group(r, redis_url, run_name, tmp_path, procs):
    """A node that never comes: each group gets its free retries, then failures are charged and
    the member is given up, counted as given_up:connection."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(2)])
    procs.start("runner", "--agent", "gateway_agents:needs_inference", "--concurrency", "2",
                "--inference-url", f"http://127.0.0.1:{free_port()}")  # fmt: skip
    sched = procs.start("scheduler", "--dataset", str(data), "--group-size", "1",
                        SQUALL_SCHEDULER__MAX_ATTEMPTS="2", SQUALL_SCHEDULER__INFRA_RETRIES="3")  # fmt: skip
    assert sched.wait(90) == 0, log_of(sched)[-3000:]
    counts = infra_counts(r, run_name)
    assert counts == {"retried:connection": 6, "charged:connection": 2, "given_up:connection": 2}, counts
    assert Ledger(r, Keys(run_name)).counts() == {"dispatched": 10, "retried": 8, "deadlettered": 2}


# --- smaller holes ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_standby_that_finds_the_run_finished_marks_its_heartbeat_stopped(
    r, redis_url, run_name, tmp_path, procs
):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(2)])
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "2")
    assert procs.start("scheduler", "--dataset", str(data), "--group-size", "1").wait(60) == 0
    late = procs.start("scheduler", "--dataset", str(data), "--group-size", "1")
    assert late.wait(60) == 0
    beats = {k.decode(): json.loads(v) for k, v in r.hgetall(Keys(run_name).heartbeats).items()}
    schedulers = {k: b for k, b in beats.items() if k.startswith("scheduler:")}
    assert schedulers and all(b.get("stopped", 0) > 0 for b in schedulers.values()), schedulers


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_validation_rounds_reward_point_is_in_the_transaction_that_closes_it(
    r, redis_url, run_name, tmp_path, procs
):
    """MONITOR shows every command as Redis ran it: the val RewardPoint's XADD sits between the
    MULTI and EXEC that also ack the round's last trajectory."""
    from test_scheduler_run import make_config, reward_points

    from squall.scheduler.scheduler import Scheduler

    rows = [{"id": i, "reward": 0.5} for i in range(3)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = make_config(redis_url, run_name, data, group_size=1, val_every=1, val_samples=2,
                         val_fraction=0.34, val_at_end=False)  # fmt: skip
    seen: list[str] = []
    stop = threading.Event()

    def monitor() -> None:
        with redis.Redis.from_url(redis_url).monitor() as m:
            for command in m.listen():
                seen.append(command["command"])
                if stop.is_set():
                    return

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    time.sleep(0.3)
    procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "2")
    keys = Keys(run_name)
    sched = Scheduler(config, r)

    def round_closed() -> bool:
        sched.step()
        return any(p.mode == "val" for p in reward_points(r, keys))

    wait_for(round_closed, 60, "a validation round to close")
    stop.set()
    r.ping()  # one more command, so the watcher wakes and returns
    watcher.join(10)
    val_points = [i for i, c in enumerate(seen) if c.startswith(f"XADD {keys.rewards}") and "val" in c]
    assert val_points, [c for c in seen if "rewards" in c][:5]
    for i in val_points:
        opened = max(j for j in range(i) if seen[j] == "MULTI")
        closed = min(j for j in range(i, len(seen)) if seen[j] == "EXEC")
        assert not any(seen[j] == "EXEC" for j in range(opened, i)), "the point is outside a transaction"
        inside = seen[opened:closed]
        assert any(c.startswith(f"XACK {keys.trajectories} scheduler") for c in inside), inside
        assert any(c.startswith(f"HSET {keys.scheduler_state}") and "val_count" in c for c in inside), inside


def test_load_config_knows_the_new_settings():
    config = load_config(
        env={}, overrides={"scheduler": {"infra_retries": 5}, "runner": {"behind_wait_s": 2}}
    )
    assert config.scheduler.infra_retries == 5 and config.runner.behind_wait_s == 2.0
    with pytest.raises(Exception, match="infra_backoff_s"):
        load_config(env={}, overrides={"scheduler": {"infra_backoff_s": 0}})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_deadline_passed_waiting_on_inference_is_an_infrastructure_failure(r, run_name, tmp_path, procs):
    """A node that takes the connection and never answers (hung, paused): the attempt's
    deadline passes inside the gateway's call, so it is `deadline`, not the agent's timeout."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # accepts (the kernel completes the handshake) and never says a word
    try:
        data = write_jsonl(tmp_path / "d.jsonl", [{"id": 0}])
        procs.start("runner", "--agent", "gateway_agents:needs_inference", "--concurrency", "2",
                    "--inference-url", f"http://127.0.0.1:{hung.getsockname()[1]}")  # fmt: skip
        heartbeats = Keys(run_name).heartbeats
        wait_for(lambda: any(k.startswith(b"runner:") for k in r.hkeys(heartbeats)), 60, "the runner up")
        sched = procs.start("scheduler", "--dataset", str(data), "--group-size", "1",
                            SQUALL_SCHEDULER__MAX_ATTEMPTS="1", SQUALL_SCHEDULER__INFRA_RETRIES="2",
                            SQUALL_SCHEDULER__TASK_TIMEOUT_S="3")  # fmt: skip
        assert sched.wait(90) == 0, log_of(sched)[-3000:]
    finally:
        hung.close()
    assert infra_counts(r, run_name) == {"retried:deadline": 2, "given_up:deadline": 1}
    assert [(t.status, t.infra) for t in trajectories(r, run_name)] == [("timeout", "deadline")] * 3
    assert Ledger(r, Keys(run_name)).counts() == {"dispatched": 3, "retried": 2, "deadlettered": 1}

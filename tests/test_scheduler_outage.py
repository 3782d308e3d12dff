"""The scheduler rides through a Redis restart, and exits naming the URL when Redis stays down.

Each test runs its own Redis (AOF on, in a temp dir) so it can stop and restart it.
"""

from __future__ import annotations

import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from runner_helpers import Procs, log_of, trajectories, write_jsonl
from waiting import wait_for

from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import LocalRedis

pytestmark = [pytest.mark.redis, pytest.mark.slow]
DOWN_S = 2.0  # how long Redis stays away in the restart test


def shutdown(server: LocalRedis) -> None:
    """A graceful SHUTDOWN (the AOF is flushed), then wait for the process to go."""
    once = redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0))  # no reconnecting after it
    try:
        once.shutdown()
    except redis.ConnectionError:
        pass  # the server hung up while exiting: that is the success case
    assert server.process is not None
    server.process.wait(10)


@pytest.fixture
def own_redis(tmp_path):
    server = LocalRedis(data_dir=tmp_path / "redis", aof=True).start()
    yield server
    server.close()


def test_scheduler_keeps_dispatching_across_a_redis_restart(own_redis, run_name, tmp_path):
    rows = [{"id": f"s{i}", "sleep": 0.05} for i in range(30)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    procs = Procs(own_redis.url, run_name, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false")
    r = redis.Redis.from_url(own_redis.url)
    try:
        procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
        sched = procs.start("scheduler", "--dataset", str(data), "--group-size", "2",
                            SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS="2")  # fmt: skip
        wait_for(lambda: len(trajectories(r, run_name)) >= 6, 30, "some trajectories before the restart")
        shutdown(own_redis)
        before = time.monotonic()
        time.sleep(DOWN_S)
        assert sched.poll() is None, log_of(sched)[-3000:]  # still waiting for Redis
        restarted = LocalRedis(port=own_redis.port, data_dir=own_redis.data_dir, aof=True).start()
        try:
            assert sched.wait(90) == 0, log_of(sched)[-3000:]
            log = log_of(sched)
            assert "redis_outage" in log and time.monotonic() - before >= DOWN_S
            keys = Keys(run_name)
            # `tasks` is trimmed as runners acknowledge it; `trajectories` has no trainer group here.
            trajs = trajectories(r, run_name)
            assert len(trajs) == 60 and len({t.key for t in trajs}) == 60  # nothing ran twice
            assert sorted(t.sample_id for t in trajs) == sorted(f"s{i}" for i in range(30) for _ in range(2))
            ledger = Ledger(r, keys)
            assert ledger.balanced() and ledger.counts() == {"dispatched": 60, "ok": 60}, ledger.counts()
            assert r.xpending(keys.trajectories, "scheduler")["pending"] == 0
        finally:
            procs.stop_all()
            restarted.close()
    finally:
        procs.stop_all()


def test_scheduler_exits_non_zero_naming_the_url_when_redis_stays_down(own_redis, run_name, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(10)])
    procs = Procs(own_redis.url, run_name, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false")
    r = redis.Redis.from_url(own_redis.url)
    keys = Keys(run_name)
    try:
        # No runner: the scheduler dispatches, then waits for trajectories that never come.
        sched = procs.start(
            "scheduler", "--dataset", str(data), "--group-size", "2", SQUALL_RUN__REDIS_OUTAGE_S="2"
        )
        wait_for(
            lambda: any(f.startswith(b"scheduler:") for f in r.hkeys(keys.heartbeats)),
            30,
            "a running scheduler",
        )
        shutdown(own_redis)
        down = time.monotonic()
        rc = sched.wait(30)
        log = log_of(sched)
        assert rc != 0, log[-3000:]
        assert f"127.0.0.1:{own_redis.port}" in log and "did not come back within 2s" in log, log[-3000:]
        assert time.monotonic() - down >= 2.0  # it did wait out the deadline first
    finally:
        procs.stop_all()

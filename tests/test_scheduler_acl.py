"""The real scheduler, runner and `squall status` as their least-privilege ACL users
(`squall acl`): every command they send on the way through a run must be granted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis
from runner_helpers import Procs, log_of, write_jsonl

from squall.shared.keys import Keys
from squall.shared.ledger import Ledger
from squall.shared.localredis import find_server_binary, free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]
RUN = "aclrun"


def _url(env_file) -> str:
    for line in env_file.read_text().splitlines():
        if line.startswith("SQUALL_RUN__REDIS_URL="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no URL in {env_file}")


def test_scheduler_runner_and_status_run_as_their_acl_users(tmp_path):
    port = free_port()
    made = subprocess.run([sys.executable, "-m", "squall.cli", "acl", "--run", RUN, "--out", str(tmp_path),
                           "--port", str(port)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr
    acl_file = next(tmp_path.glob("*.acl"))
    server = subprocess.Popen(
        [find_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--aclfile", str(acl_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        admin = redis.Redis.from_url(_url(tmp_path / "admin.env"))
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "reward": i % 2} for i in range(6)])
        runner_procs = Procs(_url(tmp_path / "runner.env"), RUN, tmp_path, SQUALL_RUNNER__GRACE_S="1")
        sched_procs = Procs(_url(tmp_path / "scheduler.env"), RUN, tmp_path, SQUALL_SCHEDULER__HOLD_UNTIL_TRAINED="false",
                            SQUALL_SCHEDULER__VAL_FRACTION="0.3", SQUALL_SCHEDULER__VAL_EVERY="1")  # fmt: skip
        try:
            runner_procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "4")
            sched = sched_procs.start("scheduler", "--dataset", str(data), "--group-size", "2")
            assert sched.wait(60) == 0, log_of(sched)[-3000:]
        finally:
            runner_procs.stop_all()
            sched_procs.stop_all()
        for proc in runner_procs.procs:
            assert proc.returncode == 0 and "NOPERM" not in log_of(proc)
        counts = Ledger(admin, Keys(RUN)).counts()
        assert counts["dispatched"] == 10 and counts.get("ok", 0) + counts.get("validated", 0) == 10, counts
        status = subprocess.run(
            [sys.executable, "-m", "squall.cli", "status", "--run", RUN, "--redis-url", _url(tmp_path / "monitor.env")],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert status.returncode == 0 and "conservation OK" in status.stdout, status.stdout + status.stderr
    finally:
        server.terminate()
        server.wait(10)

"""An agent that fails every attempt (a package missing from its environment, say) trains
nothing while the run looks busy: a runner reports it once per run after
`runner.agent_failing_after` agent failures in a row — its log, the run's `warnings` hash and
`squall status` — with a real runner, real Redis and the real status command."""

from __future__ import annotations

import subprocess

import pytest
from runner_helpers import SQUALL, Procs, dispatch, log_of, trajectories
from waiting import wait_for

from squall.runner.failwatch import AgentFailureWatch
from squall.shared.keys import Keys
from squall.shared.runwarnings import read_warnings


def test_watch_reports_failures_in_a_row_once_and_an_ok_attempt_resets_it():
    watch = AgentFailureWatch(after=3)
    assert not watch.observe("failed", "", "RuntimeError: boom")
    assert not watch.observe("failed", "", "RuntimeError: boom")
    assert not watch.observe("ok", "", None)  # a success in between: the agent can run
    assert not watch.observe("failed", "", "RuntimeError: boom")
    assert not watch.observe("failed", "no_policy_node", "no node answered")  # infrastructure's fault
    assert not watch.observe("timeout", "", "ran past the deadline")  # may be slow inference
    assert not watch.observe("skipped", "", None)
    assert not watch.observe("failed", "", "ModuleNotFoundError: No module named 'x'")
    assert watch.observe("failed", "", "RuntimeError: boom")  # three agent failures in a row
    assert not watch.observe("failed", "", "RuntimeError: boom")  # reported once
    message = watch.message("pkg.agent:run")
    assert "agent 'pkg.agent:run' failed 3 attempts in a row" in message
    assert "'RuntimeError: boom' (2 times) and 1 other error(s)" in message
    assert not AgentFailureWatch(after=0).observe("failed", "", "x")  # 0: never checked


@pytest.mark.redis
@pytest.mark.slow
def test_an_agent_failing_every_attempt_is_warned_once_in_logs_and_status(r, redis_url, run_name, tmp_path):
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__GRACE_S="1")
    dispatch(r, run_name, [{"behave": "missing_module"} for _ in range(8)])
    runner = procs.start(
        "runner", "--agent", "runner_agents:trivial", "--concurrency", "2",
        SQUALL_RUNNER__AGENT_FAILING_AFTER="5",
    )  # fmt: skip
    try:
        done = wait_for(lambda: len(trajectories(r, run_name)) == 8 and trajectories(r, run_name), 120,
                        "8 trajectories", interval=0.3)  # fmt: skip
        assert all(t.status == "failed" and "squall_test_no_such_module" in t.error for t in done)
        wait_for(lambda: r.hlen(Keys(run_name).warnings) == 1, 10, "the warning", interval=0.1)
    finally:
        procs.stop_all()
    (warning,) = read_warnings(r, Keys(run_name), {})
    assert (warning.kind, warning.subject) == ("agent_failing", "runner_agents:trivial")
    assert "failed 5 attempts in a row" in warning.message
    assert "No module named 'squall_test_no_such_module'" in warning.message
    logged = [line for line in log_of(runner).splitlines() if '"agent_failing"' in line]
    assert len(logged) == 1, logged  # once, though all 8 attempts failed

    status = subprocess.run([*SQUALL, "status", "--run", run_name, "--redis-url", redis_url],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert "WARNING    agent 'runner_agents:trivial' failed 5 attempts in a row" in status.stdout

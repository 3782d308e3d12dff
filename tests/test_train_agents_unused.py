"""A `runner.train_agents` name that no call ever uses: nothing of it trains, so it is reported
once per run — one runner's log line, the run's `warnings` hash, `squall status` (text and
--json) and the dashboard's /api/state — with real runners, the real tiny-model inference
server, real Redis and the real status and dashboard commands."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from runner_helpers import SQUALL, Procs, dispatch, log_of, trajectories
from test_gateway_agents import inference, model_dir  # noqa: F401 (fixtures)
from test_monitor_dashboard import _start_dashboard, _stop
from waiting import wait_for

from squall.runner.trainwatch import TrainAgentsWatch
from squall.shared.keys import Keys
from squall.shared.localredis import free_port
from squall.shared.runwarnings import RunWarning, read_warnings, record_once
from squall.shared.schemas import Turn


def _turns(*agents: str) -> list[Turn]:
    return [Turn(agent=a, model="policy", prompt_ids=b"", response_ids=b"", response_logprobs=b"", version=0)
            for a in agents]  # fmt: skip


def test_watch_reports_a_silent_name_once_after_enough_attempts_with_calls():
    watch = TrainAgentsWatch(["solver", "main"], after=3)
    assert watch.observe(_turns("main", "checker")) == []
    assert watch.observe([]) == []  # an attempt with no call says nothing about names
    assert watch.observe(_turns("main")) == []
    assert watch.observe(_turns("checker")) == ["solver"]  # the third attempt with calls
    assert watch.observe(_turns("main")) == []  # decided once
    message = watch.message("solver")
    assert "runner.train_agents lists 'solver'" in message and "in 3 finished attempts" in message
    assert "main (2 calls), checker (2 calls)" in message and "llm.agent_url('solver')" in message
    used = TrainAgentsWatch(["solver"], after=1)
    assert used.observe(_turns("solver")) == []
    assert TrainAgentsWatch([], after=1).observe(_turns("main")) == []  # empty list: every agent trains
    assert TrainAgentsWatch(["solver"], after=0).observe(_turns("main")) == []  # 0: never checked


@pytest.mark.redis
def test_a_warning_is_recorded_once_and_bad_fields_are_counted(r, run_name):
    keys = Keys(run_name)
    first = RunWarning("train_agent_unused", "solver", "said first", 1.0, "runner:a")
    assert record_once(r, keys, first)
    assert not record_once(r, keys, RunWarning("train_agent_unused", "solver", "said again", 2.0, "runner:b"))
    r.hset(keys.warnings, "junk:x", "not json")
    skipped: dict[str, int] = {}
    assert read_warnings(r, keys, skipped) == [first] and skipped == {"warnings": 1}


@pytest.mark.redis
@pytest.mark.slow
def test_an_unused_train_agent_is_warned_once_in_logs_status_and_dashboard(
    r,
    redis_url,
    run_name,
    tmp_path,
    inference,  # noqa: F811 (fixture)
):
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__GRACE_S="1")
    env = {"SQUALL_RUNNER__TRAIN_AGENTS": '["solver"]', "SQUALL_RUNNER__TRAIN_AGENTS_CHECK_AFTER": "2"}
    dispatch(r, run_name, [{"question": f"What is {i}+1?"} for i in range(8)])
    runners = [procs.start("runner", "--agent", "runner_agents:tiny_llm", "--inference-url", inference, **env)
               for _ in range(2)]  # fmt: skip
    try:
        done = wait_for(lambda: len(trajectories(r, run_name)) == 8 and trajectories(r, run_name), 120,
                        "8 trajectories", interval=0.3)  # fmt: skip
        assert all(
            t.status == "ok" and t.turns and not t.turns[0].trained for t in done
        )  # 'main' is not listed
        wait_for(lambda: r.hlen(Keys(run_name).warnings) == 1, 10, "the warning", interval=0.1)
    finally:
        procs.stop_all()
    logged = [line for proc in runners for line in log_of(proc).splitlines() if "train_agent_unused" in line]
    assert len(logged) == 1, logged  # once per run, whichever runner got there first
    assert "runner.train_agents lists 'solver'" in logged[0]

    status = subprocess.run([*SQUALL, "status", "--run", run_name, "--redis-url", redis_url],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0, status.stdout + status.stderr
    assert "WARNING    runner.train_agents lists 'solver', but no call came from" in status.stdout
    as_json = subprocess.run([*SQUALL, "status", "--run", run_name, "--redis-url", redis_url, "--json"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    (warning,) = json.loads(as_json.stdout)["warnings"]
    assert (warning["kind"], warning["subject"]) == ("train_agent_unused", "solver")
    assert warning["by"].startswith("runner:") and "main (" in warning["message"]

    port = free_port()
    dashboard = _start_dashboard(redis_url, run_name, port)
    try:
        state = httpx.get(f"http://127.0.0.1:{port}/api/state", timeout=10).json()
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
    finally:
        _stop(dashboard)
    assert [w["subject"] for w in state["warnings"]] == ["solver"]
    assert 'id="warnings"' in page and "st.warnings" in page


@pytest.mark.redis
def test_squall_up_prints_each_run_warning_once(r, run_name):
    import argparse

    from squall.local.up import Up
    from squall.shared.config import load_config

    up = Up(load_config(None, overrides={"run": {"name": run_name}}, env={}), argparse.Namespace())
    up.r = r
    assert "WARNING" not in up._progress_line()
    record_once(
        r,
        Keys(run_name),
        RunWarning("train_agent_unused", "solver", "no call from 'solver'", 1.0, "runner:a"),
    )
    first, second = up._progress_line(), up._progress_line()
    assert first.startswith("squall up: WARNING no call from 'solver'\n[") and "step=" in first
    assert "WARNING" not in second

"""Youtu-agent (`youtu-agent` 0.1.3, the seeds' framework), unchanged apart from its config file:
its SimpleAgent with the calculator tool runs as a command agent from its own Python 3.12 venv
(`make frameworks`), through a real runner, gateway and `squall inference` serving the
calculator policy. Every chat call must be exactly one Turn, token for token."""

from __future__ import annotations

import pytest
from framework_helpers import AGENTS_DIR, check_token_exact, extends, tool_calls_of, venv_python
from test_frameworks_agents import (  # noqa: F401 (fixtures)
    ROW,
    check_tool_round_trip,
    inference,
    model_dir,
    procs,
    run_recorded,
    tokenizer,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def youtu_python():
    return venv_python("youtu")


def test_youtu_simple_agent_is_token_exact_and_runs_its_tool(
    youtu_python,
    r,
    run_name,
    procs,  # noqa: F811
    inference,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [youtu_python, str(AGENTS_DIR / "youtu_calc.py")])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    assert calls and {c["agent"] for c in calls} == {"main"}
    assert calls[0]["request"]["tool_choice"] == "required" and tool_calls_of(calls[0]["message"])
    check_tool_round_trip(calls, traj)
    assert len(calls) >= 2 and extends(traj.turns[0], traj.turns[1])
    assert traj.reward in (0.0, 1.0) and ROW["answer"] == 95

"""Youtu-agent (`youtu-agent` 0.1.3, the seeds' framework), unchanged apart from its config file:
its SimpleAgent with the calculator tool runs as a command agent from its own Python 3.12 venv
(`make frameworks`), through a real runner, gateway and `squall inference` serving the
calculator policy. Every chat call must be exactly one Turn, token for token."""

from __future__ import annotations

import json

import pytest
from framework_helpers import (
    AGENTS_DIR,
    check_token_exact,
    extends,
    recorded_command,
    run_command_agent,
    tool_calls_of,
    venv_python,
)
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


def test_youtu_agent_on_the_responses_api_is_recorded_and_runs_its_tool(
    youtu_python,
    r,
    run_name,
    procs,  # noqa: F811
    inference,  # noqa: F811
    tokenizer,  # noqa: F811
    tmp_path,
):
    """The same agent with `UTU_LLM_TYPE=responses`: the Agents SDK's Responses model, through the
    gateway's /v1/responses. One Turn per call; the tool's result goes back as a
    function_call_output item."""
    from examples.calc.agent import calculate

    record = tmp_path / "record.json"
    command = "UTU_LLM_TYPE=responses " + recorded_command(
        record, youtu_python, str(AGENTS_DIR / "youtu_calc.py")
    )
    traj = run_command_agent(r, run_name, procs, command, inference, ROW)
    assert traj.status == "ok", traj.error
    exchanges = [e for e in json.loads(record.read_text())["exchanges"] if e["path"].endswith("/responses")]
    assert exchanges and all(e["status"] == 200 for e in exchanges), exchanges
    assert len(traj.turns) == len(exchanges) and all(t.agent == "main" and t.trained for t in traj.turns)
    first = json.loads(exchanges[0]["response"])
    calls = [o for o in first["output"] if o["type"] == "function_call"]
    assert exchanges[0]["request"]["tool_choice"] == "required" and calls
    text = tokenizer.decode(traj.turns[0].response_tokens.tolist(), skip_special_tokens=False)
    assert text.startswith('{"name": "calculator"') and calls[0]["name"] == "calculator"  # after the prefill
    expression = json.loads(calls[0]["arguments"])["expression"]
    sent_back = [i for i in exchanges[1]["request"]["input"] if i.get("type") == "function_call_output"]
    assert sent_back and sent_back[0]["call_id"] == calls[0]["call_id"]
    assert sent_back[0]["output"] == str(calculate(expression))
    # The SDK sends the call back as a function_call item; re-rendered, it is the sampled tokens.
    assert traj.turns[1].extends is True

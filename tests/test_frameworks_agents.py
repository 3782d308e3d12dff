"""Agent frameworks, unchanged apart from the base URL, through a real runner (command agents),
its gateway and `squall inference` serving the calculator policy: a bash + curl agent, AutoGen
AgentChat (one agent; a two-agent team on per-agent URLs) and the OpenAI Agents SDK (streamed).
Every chat call must be exactly one Turn, token for token (framework_helpers.check_token_exact).
AutoGen and the Agents SDK run from their own venv (`make frameworks`); see docs/frameworks.md.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from framework_helpers import (
    AGENTS_DIR,
    POLICY,
    chat_exchanges,
    check_token_exact,
    extends,
    need_tools,
    recorded_command,
    run_command_agent,
    tool_calls_of,
    tool_results,
    venv_python,
)
from runner_helpers import Procs
from test_gateway_agents import start_inference

from examples.calc.agent import calculate, score

pytestmark = [pytest.mark.redis, pytest.mark.slow]

QUESTION = "Tom has 37 apples and buys 58 more. How many apples does Tom have now?"
ROW = {"question": QUESTION, "answer": 95}


# The framework's interpreter (or tools) are fixtures listed first, so a test whose framework is
# missing skips before the inference server starts.
@pytest.fixture(scope="module")
def agents_python():
    return venv_python("agents")


@pytest.fixture(scope="module")
def crewai_python():
    return venv_python("crewai")


@pytest.fixture(scope="module")
def litellm_python():
    return venv_python("litellm")


@pytest.fixture(scope="module")
def shell_tools():
    need_tools("bash", "curl", "jq", "awk")


@pytest.fixture(scope="module")
def model_dir():
    return str(POLICY)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def inference(model_dir, tmp_path_factory):
    proc, url = start_inference(model_dir, tmp_path_factory.mktemp("inference"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def procs(redis_url, run_name, tmp_path):
    p = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__GRACE_S="1")
    yield p
    p.stop_all()


def run_recorded(r, run_name, procs, inference, tmp_path: Path, argv: list[str], row: dict = ROW):
    record = tmp_path / "record.json"
    traj = run_command_agent(r, run_name, procs, recorded_command(record, *argv), inference, row)
    assert traj.status == "ok", traj.error
    return traj, chat_exchanges(record)


def check_tool_round_trip(calls: list[dict], traj) -> None:
    """Where the model called the calculator, the framework ran it and sent the result back."""
    for i, call in enumerate(calls[:-1]):
        for name, arguments in tool_calls_of(call["message"]):
            assert name == "calculator"
            assert str(calculate(arguments["expression"])) in tool_results(calls[i + 1 :])


def test_bash_curl_agent_is_token_exact_and_runs_its_tool(
    shell_tools, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               ["bash", str(AGENTS_DIR / "calc_curl.sh")], {**ROW, "seed": 0})  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    assert calls[0]["request"]["tool_choice"] == "required" and tool_calls_of(calls[0]["message"])
    assert len(calls) >= 2 and calls[1]["request"]["messages"][-1]["role"] == "tool"
    check_tool_round_trip(calls, traj)
    # The script sends the assistant message back as it got it: the history re-renders to the
    # very tokens that were sampled, so the trainer can merge the turns.
    assert all(extends(a, b) for a, b in zip(traj.turns, traj.turns[1:], strict=False))
    assert traj.reward == score(calls[-1]["message"]["content"], ROW["answer"])


def test_bash_agent_reports_a_clear_error_when_the_endpoint_refuses(shell_tools, tmp_path):
    dead = "http://127.0.0.1:9/v1"  # discard port: nothing listens
    run = subprocess.run(["bash", str(AGENTS_DIR / "calc_curl.sh")], input=json.dumps(ROW), text=True,
                         capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": dead})  # fmt: skip
    assert run.returncode != 0 and "127.0.0.1" in run.stderr and run.stdout == ""


def test_autogen_assistant_agent_is_token_exact(
    agents_python, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [agents_python, str(AGENTS_DIR / "autogen_calc.py"), "single"])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    assert calls and {c["agent"] for c in calls} == {"main"}
    assert calls[0]["request"]["messages"][0]["content"] == "Solve the problem. Reply with the number."
    check_tool_round_trip(calls, traj)
    if tool_calls_of(calls[0]["message"]):  # reflect_on_tool_use: one more call, tools off
        reflect = calls[1]["request"]
        assert len(calls) == 2 and (reflect.get("tool_choice") == "none" or not reflect.get("tools"))
    else:
        assert len(calls) == 1


def test_autogen_team_calls_are_attributed_to_each_agent(
    agents_python, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [agents_python, str(AGENTS_DIR / "autogen_calc.py"), "team"])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    agents = [c["agent"] for c in calls]
    assert agents[0] == "solver" and agents[-1] == "checker" and set(agents) == {"solver", "checker"}
    assert all(c["streamed"] for c in calls)  # model_client_stream: SSE re-emitted by the gateway
    check_tool_round_trip(calls, traj)
    # The checker sees the solver's last message as the conversation so far.
    assert QUESTION in json.dumps(calls[-1]["request"]["messages"])


def test_openai_agents_sdk_streamed_agent_is_token_exact(
    agents_python, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [agents_python, str(AGENTS_DIR / "openai_agents_calc.py")])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    assert all(c["streamed"] for c in calls)
    assert calls[0]["request"]["tool_choice"] == "required" and tool_calls_of(calls[0]["message"])
    check_tool_round_trip(calls, traj)
    # The SDK ran the tool and asked again with tool_choice reset; its history re-renders to the
    # sampled tokens.
    assert len(calls) >= 2 and calls[1]["request"].get("tool_choice") in (None, "auto")
    assert extends(traj.turns[0], traj.turns[1])


def test_crewai_crew_calls_are_attributed_to_each_agent(
    crewai_python, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [crewai_python, str(AGENTS_DIR / "crewai_calc.py")])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    agents = [c["agent"] for c in calls]
    assert agents[0] == "solver" and agents[-1] == "checker" and set(agents) == {"solver", "checker"}
    assert QUESTION in calls[0]["request"]["messages"][-1]["content"]
    check_tool_round_trip(calls, traj)


def test_litellm_client_tools_and_streaming_are_token_exact(
    litellm_python, r, run_name, procs, inference, tokenizer, tmp_path
):
    traj, calls = run_recorded(r, run_name, procs, inference, tmp_path,
                               [litellm_python, str(AGENTS_DIR / "litellm_calc.py")])  # fmt: skip
    check_token_exact(tokenizer, traj, calls)
    assert calls[0]["request"]["tool_choice"] == "required" and not calls[0]["streamed"]
    assert all(c["streamed"] for c in calls[1:])
    check_tool_round_trip(calls, traj)
    if tool_calls_of(calls[0]["message"]):
        assert len(calls) >= 2 and extends(traj.turns[0], traj.turns[1])

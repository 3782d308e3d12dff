"""The runner's LLM gateway with the real inference server (tiny model) and real agents:
the openai SDK (chat, tools, streaming, completions) and LangGraph, unchanged apart from the
base URL. Their trajectories' token ids must decode to exactly the conversation they saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from runner_helpers import Procs, continuation_expected, dispatch, trajectories
from waiting import wait_for

from squall.shared.localredis import free_port

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from squall.inference.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def start_inference(model_dir: str, log_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SQUALL_RUN__LOG_LEVEL": "WARNING"}
    log = open(log_dir / f"inference-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "inference", "--model", model_dir, "--port", str(port), "--no-follow", *extra],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy():
        assert proc.poll() is None, Path(log.name).read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 90, "the inference server", interval=0.3)
    return proc, url


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


def run_one(r, run, procs, agent, inference_urls, row, **env):
    dispatch(r, run, [row])
    urls = [inference_urls] if isinstance(inference_urls, str) else inference_urls
    flags = [arg for url in urls for arg in ("--inference-url", url)]
    procs.start("runner", "--agent", agent, *flags, **env)
    (traj,) = wait_for(lambda: trajectories(r, run), 60, f"{agent}'s trajectory", interval=0.2)
    return traj


def expected_prompt(tokenizer, call) -> str:
    if "prompt" in call:
        return call["prompt"]
    return tokenizer.apply_chat_template(
        call["messages"], tools=call.get("tools"), add_generation_prompt=True, tokenize=False
    )


def check_tokens(tokenizer, traj, calls) -> None:
    """Each turn's ids decode to exactly the prompt the agent sent and the reply it got."""
    assert len(traj.turns) == len(calls)
    for call, turn in zip(calls, traj.turns, strict=True):
        prompt = tokenizer.decode(turn.prompt_tokens.tolist(), skip_special_tokens=False)
        assert prompt == expected_prompt(tokenizer, call)
        response = tokenizer.decode(turn.response_tokens.tolist(), skip_special_tokens=False)
        eos = "<|im_end|>" if turn.finish_reason == "stop" else ""
        assert response == (call["content"] or "") + eos
        assert call["finish_reason"] in (None, turn.finish_reason)
        assert turn.logprobs.shape == turn.response_tokens.shape and (turn.logprobs <= 0).all()
        assert (
            turn.version == 0 and turn.trained and turn.node.startswith("127.0.0.1:") and turn.latency_s > 0
        )


def test_openai_sdk_chat_trajectory_is_token_exact(r, run_name, tmp_path, procs, inference, tokenizer):
    record = tmp_path / "calls.json"
    traj = run_one(r, run_name, procs, "gateway_agents:openai_chat", inference,
                   {"question": "What is 2+2?", "record": str(record)})  # fmt: skip
    assert traj.status == "ok", traj.error
    calls = json.loads(record.read_text())["calls"]
    check_tokens(tokenizer, traj, calls)
    assert all(c["extra"] == [] and c["logprobs"] is False for c in calls)  # squall's fields stripped
    assert traj.final_answer == calls[-1]["content"]
    # Turn 2's prompt extends turn 1's prompt + response token for token (the trainer merges them).
    first, second = traj.turns
    joined = first.prompt_tokens.tolist() + first.response_tokens.tolist()
    if first.finish_reason == "stop" and continuation_expected(tokenizer, first, second):
        assert second.prompt_tokens.tolist()[: len(joined)] == joined and second.extends is True


def test_openai_sdk_tools_streaming_and_completions(r, run_name, tmp_path, procs, inference, tokenizer):
    record = tmp_path / "calls.json"
    traj = run_one(r, run_name, procs, "gateway_agents:openai_tools", inference, {"record": str(record)})
    assert traj.status == "ok" and traj.reward == 0.5, traj.error
    calls = json.loads(record.read_text())["calls"]
    check_tokens(tokenizer, traj, calls)
    assert "<tools>" in expected_prompt(tokenizer, calls[0]) and "<tool_response>" in expected_prompt(
        tokenizer, calls[0]
    )
    assert calls[1]["usage"]["completion_tokens"] == len(traj.turns[1].response_tokens)


def test_langgraph_agent_trajectory_is_token_exact(r, run_name, tmp_path, procs, inference, tokenizer):
    record = tmp_path / "calls.json"
    traj = run_one(r, run_name, procs, "gateway_agents:langgraph_react", inference,
                   {"question": "Weather in Oslo?", "record": str(record)})  # fmt: skip
    assert traj.status == "ok", traj.error
    calls = json.loads(record.read_text())["calls"]
    # The random tiny model answers without a tool call, so the graph makes exactly one call.
    check_tokens(tokenizer, traj, calls)


def test_named_agents_and_frozen_models_are_recorded_untrained(
    r, run_name, procs, inference, model_dir, tmp_path
):
    judge, judge_url = start_inference(model_dir, tmp_path, "--served-name", "judge")
    try:
        traj = run_one(
            r, run_name, procs, "gateway_agents:multi_agent", inference, {},
            SQUALL_RUNNER__FROZEN_MODELS=json.dumps({"judge": judge_url}),
            SQUALL_RUNNER__TRAIN_AGENTS='["main"]',
        )  # fmt: skip
    finally:
        judge.terminate()
        judge.wait(10)
    assert traj.status == "ok" and traj.reward == 2.0, traj.error  # /v1/models lists policy + judge
    player, opponent, judge = traj.turns
    assert (player.agent, player.trained, player.version) == ("main", True, 0)
    assert (opponent.agent, opponent.trained, opponent.version) == ("opponent", False, 0)
    # The frozen judge is a squall node serving version 0: its turn keeps the version the
    # endpoint reported (issue 11: an opponent's version is visible, e.g. a pinned snapshot's).
    assert (judge.model, judge.trained, judge.version) == ("judge", False, 0)
    assert len(player.response_tokens) > 0 and len(judge.response_tokens) == 0


def test_failover_to_a_live_node_then_clear_error_when_all_are_down(r, run_name, procs, inference):
    dead = f"http://127.0.0.1:{free_port()}"
    traj = run_one(r, run_name, procs, "gateway_agents:needs_inference", [dead, inference], {})
    assert traj.status == "ok" and traj.turns[0].node.endswith(inference.rsplit(":", 1)[1]), traj.error
    procs.stop_all()
    r.flushdb()
    traj = run_one(
        r, run_name, procs, "gateway_agents:needs_inference", dead, {}, SQUALL_RUNNER__UPSTREAM_RETRIES="2"
    )
    assert traj.status == "failed" and "inference failed 3 time(s)" in traj.error and dead in traj.error

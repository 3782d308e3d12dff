"""Anthropic Messages and OpenAI Responses through the runner's gateway, with the official SDKs
as clients and the real inference server (tiny model): every call is recorded token-exact
(prompt ids = the chat template's rendering of the conversation, response ids decode to what
the agent got or streamed), attributed to its agent, and bad requests get the protocol's own
error shape naming the field, with the gateway still serving."""

# ruff: noqa: F811  (the fixtures come from test_gateway_agents)
from __future__ import annotations

import contextlib
import json
import subprocess

import pytest
from runner_helpers import continuation_expected, log_of, trajectories
from test_gateway_agents import inference, model_dir, procs, run_one, tokenizer  # noqa: F401 (fixtures)
from waiting import reap, wait_for

from squall.shared.heartbeat import read_heartbeats
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(240)]

MESSAGE_EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop"]  # fmt: skip


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def rendered(tokenizer, messages, tools=None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def reply_text(turn_text: str, finish: str) -> str:
    """A turn's decoded response without the end-of-turn token the agent never sees."""
    return turn_text.removesuffix("<|im_end|>") if finish == "stop" else turn_text


def run(r, run_name, tmp_path, procs, inference, agent, env=None, **row):
    record = tmp_path / "calls.json"
    traj = run_one(r, run_name, procs, f"protocol_agents:{agent}", inference, {**row, "record": str(record)},
                   **(env or {}))  # fmt: skip
    calls = json.loads(record.read_text())["calls"] if record.exists() else []
    return traj, calls


def test_messages_plain_sync_async_streaming(r, run_name, tmp_path, procs, inference, tokenizer):
    traj, calls = run(r, run_name, tmp_path, procs, inference, "messages_plain", question="What is 2+2?")
    assert traj.status == "ok", traj.error
    assert len(traj.turns) == 3 and all(
        t.trained and t.agent == "main" and t.version == 0 for t in traj.turns
    )
    first = traj.turns[0]
    system = {"role": "system", "content": "You are terse."}
    assert decode(tokenizer, first.prompt_tokens) == rendered(tokenizer, [system, calls[0]["messages"][0]])
    for call, turn in zip(calls, traj.turns, strict=True):
        text = "".join(b["text"] for b in call["content"] if b["type"] == "text")
        assert text == reply_text(decode(tokenizer, turn.response_tokens), turn.finish_reason)
        assert call["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[turn.finish_reason]
        assert turn.logprobs.shape == turn.response_tokens.shape
    assert calls[0]["usage"]["input_tokens"] == len(first.prompt_tokens)
    assert calls[0]["usage"]["output_tokens"] == len(first.response_tokens)
    # The second turn re-sends the first reply as content blocks: its prompt extends turn 1
    # whenever the reply survives re-tokenisation.
    if first.finish_reason == "stop":
        assert traj.turns[1].extends is continuation_expected(tokenizer, first, traj.turns[1])
    streamed = calls[2]
    assert streamed["streamed"] == reply_text(decode(tokenizer, traj.turns[2].response_tokens),
                                              traj.turns[2].finish_reason)  # fmt: skip
    assert [e for e in streamed["events"] if e in MESSAGE_EVENTS[:1]] == ["message_start"]
    assert streamed["events"][-1] == "message_stop" and "message_delta" in streamed["events"]
    assert traj.final_answer == streamed["streamed"]


def test_messages_tools_round_trip_match_chat_completions(r, run_name, tmp_path, procs, inference, tokenizer):
    traj, calls = run(r, run_name, tmp_path, procs, inference, "messages_tools")
    assert traj.status == "ok", traj.error
    messages_turn, chat_turn, forced = traj.turns
    # Same conversation by Messages and by Chat Completions: the same prompt ids.
    assert messages_turn.prompt_tokens.tolist() == chat_turn.prompt_tokens.tolist()
    prompt = decode(tokenizer, messages_turn.prompt_tokens)
    assert prompt == rendered(tokenizer, calls[1]["messages"], calls[1]["tools"])
    assert "<tools>" in prompt and "<tool_response>" in prompt and "Let me look." in prompt
    if calls[0]["stop_reason"] == "stop_sequence":
        assert calls[0]["stop_sequence"] == "\n\n"
    # Forced tool call: the prefill is in the prompt, the parsed call comes back as tool_use.
    assert decode(tokenizer, forced.prompt_tokens).endswith('<tool_call>\n{"name": "get_weather')
    assert calls[2]["events"][0] == "message_start" and calls[2]["events"][-1] == "message_stop"
    kinds = [b["type"] for b in calls[2]["content"]]
    if forced.finish_reason == "tool_calls":
        assert "tool_use" in kinds and calls[2]["stop_reason"] == "tool_use"
        assert [b["name"] for b in calls[2]["content"] if b["type"] == "tool_use"] == ["get_weather"]
    else:  # the random tiny model may not close the call within max_tokens: text then
        assert calls[2]["stop_reason"] in ("max_tokens", "end_turn")


def test_per_agent_urls_attribute_messages_calls(r, run_name, tmp_path, procs, inference):
    traj, _ = run(r, run_name, tmp_path, procs, inference, "messages_agents")
    assert traj.status == "ok", traj.error
    assert [t.agent for t in traj.turns] == ["alice", "bob"]
    assert all(t.extends is None for t in traj.turns)  # one call per agent: nothing to continue


def test_responses_plain_previous_response_id_streaming(r, run_name, tmp_path, procs, inference, tokenizer):
    traj, calls = run(r, run_name, tmp_path, procs, inference, "responses_plain", question="What is 2+2?")
    assert traj.status == "ok", traj.error
    assert len(traj.turns) == 3
    system = {"role": "system", "content": "You are terse."}
    user = {"role": "user", "content": "What is 2+2?"}
    assert decode(tokenizer, traj.turns[0].prompt_tokens) == rendered(tokenizer, [system, user])
    # previous_response_id: the second prompt is the first conversation plus the new input.
    assistant = {"role": "assistant", "content": calls[0]["text"]}
    follow = {"role": "user", "content": "Say more."}
    assert decode(tokenizer, traj.turns[1].prompt_tokens) == rendered(
        tokenizer, [system, user, assistant, follow]
    )
    for call, turn in zip(calls, traj.turns, strict=True):
        assert call["text"] == reply_text(decode(tokenizer, turn.response_tokens), turn.finish_reason)
    assert calls[0]["status"] == ("completed" if traj.turns[0].finish_reason == "stop" else "incomplete")
    assert calls[0]["usage"]["input_tokens"] == len(traj.turns[0].prompt_tokens)
    if traj.turns[0].finish_reason == "stop":
        assert traj.turns[1].extends is continuation_expected(tokenizer, traj.turns[0], traj.turns[1])
    streamed = calls[2]
    assert (
        streamed["streamed"]
        == streamed["text"]
        == reply_text(decode(tokenizer, traj.turns[2].response_tokens), traj.turns[2].finish_reason)
    )
    assert streamed["events"][:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in streamed["events"]
    assert streamed["events"][-1] in ("response.completed", "response.incomplete")


def test_responses_function_call_round_trip(r, run_name, tmp_path, procs, inference, tokenizer):
    traj, calls = run(r, run_name, tmp_path, procs, inference, "responses_tools")
    assert traj.status == "ok", traj.error
    first, forced, follow = traj.turns
    from protocol_agents import CHAT_WEATHER

    same = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]  # fmt: skip
    assert decode(tokenizer, first.prompt_tokens) == rendered(tokenizer, same, [CHAT_WEATHER])
    assert decode(tokenizer, forced.prompt_tokens).endswith('<tool_call>\n{"name": "get_weather')
    events = calls[1]["events"]
    assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
    kinds = [o["type"] for o in calls[1]["output"]]
    if forced.finish_reason == "tool_calls":
        assert "function_call" in kinds and "response.function_call_arguments.done" in events
        assert calls[2]["answered"] >= 1
        assert "<tool_response>\ncloudy\n</tool_response>" in decode(tokenizer, follow.prompt_tokens)
    # previous_response_id carried the forced call's conversation into the follow-up.
    assert "Weather in Oslo?" in decode(tokenizer, follow.prompt_tokens)


def test_bad_requests_get_protocol_errors_and_the_gateway_serves_on(r, run_name, tmp_path, procs, inference):
    traj, calls = run(r, run_name, tmp_path, procs, inference, "bad_requests")
    assert traj.status == "ok", traj.error
    got = calls[0]

    def anthropic_error(name: str, *words: str) -> None:
        body = got[name]["body"]
        assert got[name]["status"] == 400 and body["type"] == "error", got[name]
        assert body["error"]["type"] == "invalid_request_error"
        assert all(w in body["error"]["message"] for w in words), body

    def openai_error(name: str, param: str, *words: str) -> None:
        body = got[name]["body"]
        body = body.get("error", body)  # raw HTTP body, or the SDK's unwrapped error object
        assert got[name]["status"] == 400 and body["type"] == "invalid_request_error", got[name]
        assert body.get("param") == param and all(w in body["message"] for w in words), body

    anthropic_error("messages_malformed", "not valid JSON")
    anthropic_error("no_max_tokens", "max_tokens")
    anthropic_error("unknown_block", "messages.0.content.0.type", "hologram")
    anthropic_error("unknown_tool_id", "messages.0.content.0.tool_use_id", "toolu_nope")
    openai_error("responses_malformed", None, "not valid JSON")
    openai_error("unknown_item", "input[0].type", "hologram")
    openai_error("unknown_call_id", "input[0].call_id", "call_nope")
    openai_error("unknown_previous", "previous_response_id", "resp_nope")
    assert got["alive"]["messages"] in ("end_turn", "max_tokens")
    assert got["alive"]["responses"] in ("completed", "incomplete")
    assert len(traj.turns) == 2  # only the two good calls reached the model
    assert Ledger(r, Keys(run_name)).state_of(traj.key) == "ok"


@pytest.mark.parametrize("protocol", ["messages", "responses"])
def test_context_overflow_is_refused_counted_and_fails_the_attempt(
    r,
    run_name,
    tmp_path,
    procs,
    inference,
    protocol,
):
    env = {"SQUALL_RUNNER__HEARTBEAT_S": "0.2"}
    traj, calls = run(r, run_name, tmp_path, procs, inference, "overflow", env, protocol=protocol, words=3000)
    (got,) = calls
    assert got["status"] == 400, got
    if protocol == "messages":
        assert got["body"]["type"] == "error" and "prompt is too long" in got["body"]["error"]["message"]
    else:
        body = got["body"].get("error", got["body"])
        assert body["code"] == "context_length_exceeded" and "context" in body["message"]
    assert traj.status == "failed" and traj.error and "context overflow" in traj.error, traj.error
    assert traj.turns == []
    wait_for(lambda: Ledger(r, Keys(run_name)).state_of(traj.key) == "failed", 10, "the failed state")
    assert len(trajectories(r, run_name)) == 1

    def counted():
        beats = [
            beat for _, beat, _ in read_heartbeats(r, Keys(run_name)) if beat and beat.service == "runner"
        ]
        return bool(beats) and beats[0].stats.get("context_overflows") == 1

    wait_for(counted, 10, "the runner's heartbeat counting the overflow")


@pytest.fixture(scope="module")
def taught_inference(model_dir, tmp_path_factory):
    """The tiny model taught one tool conversation (call `calculator`, then answer), served."""
    from inference_helpers import teach_tool_use
    from test_gateway_agents import start_inference

    taught = teach_tool_use(model_dir, tmp_path_factory.mktemp("taught"))
    proc, url = start_inference(str(taught), tmp_path_factory.mktemp("taught-inference"))
    yield url
    stop(proc)


def check_calculator_turns(tokenizer, traj) -> None:
    """Call, tool result, answer: turn 2 extends turn 1 token for token; turns 1 and 3 (the same
    request) sample the same ids at temperature 0."""
    from inference_helpers import TOOL_ANSWER, TOOL_ARGS

    assert traj.status == "ok", traj.error
    first, second, again = traj.turns
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    call = decode(tokenizer, first.response_tokens)
    assert (
        call
        == f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps(TOOL_ARGS)}}}\n</tool_call><|im_end|>'
    )
    assert decode(tokenizer, second.response_tokens) == f"{TOOL_ANSWER}<|im_end|>"
    assert second.extends is True and "<tool_response>\n84\n</tool_response>" in decode(
        tokenizer, second.prompt_tokens
    )
    assert again.response_tokens.tolist() == first.response_tokens.tolist()


@pytest.mark.timeout(600)  # teaching the tiny model the tool takes minutes on a loaded CPU
def test_messages_tool_use_round_trip_with_a_taught_model(
    r, run_name, tmp_path, procs, taught_inference, tokenizer
):
    from inference_helpers import TOOL_ANSWER, TOOL_ARGS

    traj, calls = run(r, run_name, tmp_path, procs, taught_inference, "messages_calculator")
    check_calculator_turns(tokenizer, traj)
    first, second, streamed = calls
    assert first["stop_reason"] == "tool_use" and streamed["stop_reason"] == "tool_use"
    for call in (first, streamed):
        (use,) = [b for b in call["content"] if b["type"] == "tool_use"]
        assert use["name"] == "calculator" and use["input"] == TOOL_ARGS
    assert second["stop_reason"] == "end_turn" and second["content"] == [
        {"type": "text", "text": TOOL_ANSWER}
    ]
    assert first["usage"]["output_tokens"] == len(traj.turns[0].response_tokens)
    assert streamed["events"][0] == "message_start" and streamed["events"][-1] == "message_stop"
    assert "input_json" in streamed["events"] or "content_block_delta" in streamed["events"]


@pytest.mark.timeout(600)  # teaching the tiny model the tool takes minutes on a loaded CPU
def test_responses_function_call_round_trip_with_a_taught_model(
    r, run_name, tmp_path, procs, taught_inference, tokenizer
):
    from inference_helpers import TOOL_ANSWER, TOOL_ARGS

    traj, calls = run(r, run_name, tmp_path, procs, taught_inference, "responses_calculator")
    check_calculator_turns(tokenizer, traj)
    first, second, streamed = calls
    for call in (first, streamed):
        (function_call,) = [o for o in call["output"] if o["type"] == "function_call"]
        assert function_call["name"] == "calculator" and json.loads(function_call["arguments"]) == TOOL_ARGS
    assert json.loads(streamed["arguments"]) == TOOL_ARGS
    assert "response.function_call_arguments.done" in streamed["events"]
    assert second["text"] == TOOL_ANSWER


def test_a_rewritten_history_is_counted_as_a_continuity_break(r, run_name, tmp_path, procs, inference):
    traj, _ = run(r, run_name, tmp_path, procs, inference, "rewrites_history",
                  env={"SQUALL_RUNNER__HEARTBEAT_S": "0.2", "SQUALL_RUN__LOG_LEVEL": "INFO"})  # fmt: skip
    assert traj.status == "ok", traj.error
    first, second = traj.turns
    assert first.extends is None and second.extends is False
    (runner,) = procs.procs
    wait_for(lambda: "token_continuity_break" in log_of(runner), 10, "the continuity-break log line")
    line = next(x for x in log_of(runner).splitlines() if "token_continuity_break" in x)
    event = json.loads(line)
    assert event["attempt"] == traj.key and event["breaks"] == 1 and event["turn"] == 1
    assert event["first_diff"] < event["history_tokens"] <= event["prompt_tokens"]

    def runner_beat():
        beats = [
            beat for _, beat, _ in read_heartbeats(r, Keys(run_name)) if beat and beat.service == "runner"
        ]
        return beats and beats[0].stats.get("continuity_breaks") == 1 and beats[0]

    beat = wait_for(runner_beat, 10, "the runner's heartbeat counting the break")
    assert beat.stats["context_overflows"] == 0


def stop(proc) -> None:
    """SIGTERM, then a kill if the server is still up after 30 s (a loaded machine is slow)."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    reap(proc)

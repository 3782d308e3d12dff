"""Tool calls through the server with the openai SDK: a tiny model taught one conversation
(call `calculator`, then answer) is served, and the round trip is checked token for token."""

from __future__ import annotations

import json

import pytest
import torch
from inference_helpers import CALC_TOOL, TOOL_ANSWER, TOOL_ARGS, TOOL_QUESTION, NodeThread, teach_tool_use

from squall.inference.tiny import build_tiny_model

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    base = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    taught = teach_tool_use(base, tmp_path_factory.mktemp("taught"))
    server = NodeThread(taught, api_key="sk-test").start()
    yield server
    server.stop()


def test_tool_call_round_trip(node):
    client = node.client()
    first = client.chat.completions.create(
        model="policy", messages=TOOL_QUESTION, tools=[CALC_TOOL], temperature=0, max_tokens=48,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == TOOL_ARGS

    messages = [
        *TOOL_QUESTION,
        choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "84"},
    ]
    second = client.chat.completions.create(
        model="policy", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=24,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and answer.message.content == TOOL_ANSWER
    assert not answer.message.tool_calls
    # The second prompt extends the first prompt + sampled response token for token, so the
    # trainer can merge both turns into one sequence.
    before = choice.model_extra["prompt_token_ids"] + choice.model_extra["token_ids"]
    assert answer.model_extra["prompt_token_ids"][: len(before)] == before


def test_tool_call_streaming(node):
    stream = node.client().chat.completions.create(
        model="policy", messages=TOOL_QUESTION, tools=[CALC_TOOL], temperature=0, max_tokens=48, stream=True
    )
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["calculator"]
    assert json.loads(calls[0].function.arguments) == TOOL_ARGS


def test_tool_choice_none_hides_tools_and_named_choice_is_forced(node):
    client = node.client()
    plain = client.chat.completions.create(
        model="policy", messages=TOOL_QUESTION, tools=[CALC_TOOL], tool_choice="none", temperature=0,
        max_tokens=8, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert plain.choices[0].finish_reason != "tool_calls"
    assert "<tools>" not in node.node.engine.tokenizer.decode(
        plain.choices[0].model_extra["prompt_token_ids"]
    )
    forced = client.chat.completions.create(
        model="policy", messages=TOOL_QUESTION, tools=[CALC_TOOL], temperature=0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "calculator"}},
    )  # fmt: skip
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.tool_calls[0].function.name == "calculator"

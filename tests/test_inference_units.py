"""Pure parts of the inference service: sampling against its plain definition, stop strings,
tool-call parsing and tool-schema checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from squall.inference.engines.detokenize import Detokenizer
from squall.inference.engines.sampling import reference_sample, sample
from squall.inference.toolcalls import (
    ToolError,
    forced_prefix,
    parse_tool_calls,
    resolve_tool_choice,
    validate_tools,
)


@pytest.mark.parametrize("seed", range(5))
def test_sample_matches_reference_row_by_row(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, vocab = 16, 50
    logits = torch.randn(batch, vocab, generator=gen) * 3
    temps = torch.tensor([0.0, 0.3, 1.0, 1.7] * 4)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.05] * 2 + [0.999, 1.0, 0.7, 0.3] * 2)
    uniforms = torch.rand(batch, generator=gen)
    tokens, logprobs = sample(logits, temps, top_p, uniforms)
    for row in range(batch):
        expected = reference_sample(logits[row], float(temps[row]), float(top_p[row]), float(uniforms[row]))
        assert int(tokens[row]) == expected, row
        raw = torch.log_softmax(logits[row].double(), -1)[expected]
        assert math.isclose(float(logprobs[row]), float(raw), abs_tol=1e-5)  # temperature-1 logprob


def test_sample_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample(logits, torch.full((20000,), 0.5), torch.ones(20000), torch.rand(20000, generator=gen))
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    expected = torch.softmax(logits[0].double() / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.015)


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_detokenizer_cuts_at_stop_string_and_holds_back_partial_matches():
    detok = Detokenizer(_decode, ("END",), incremental=True)
    pieces, stopped = [], False
    for ch in "abcEN":
        stopped = detok.push(ord(ch))
        pieces.append(detok.take(final=False))
    assert not stopped and "".join(pieces) == "abc"  # "EN" could begin "END": held back
    assert detok.push(ord("D"))
    assert "".join(pieces) + detok.take(final=True) == "abc"


def test_detokenizer_final_text_is_a_full_decode():
    detok = Detokenizer(_decode, (), incremental=False)
    for ch in "hello":
        detok.push(ord(ch))
    assert detok.take(final=True) == "hello"


def test_parse_tool_calls_into_openai_format():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "calculator", "arguments": json.dumps({"expression": "1 + 2"})}


def test_parse_tool_calls_leaves_broken_json_as_content():
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(text) == (text, [])
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
    content, calls = parse_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, "tools must be a list"),
        ([{"type": "retrieval"}], "tools[0]: must be an object with type 'function'"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "parameters: must be a JSON schema",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "parameters.type",
        ),
        (
            [
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "f"}},
            ],
            "defined twice",
        ),
    ],
)
def test_malformed_tools_are_named(tools, message):
    with pytest.raises(ToolError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        validate_tools(tools)


def test_tool_choice_and_forced_prefix():
    tools = [{"type": "function", "function": {"name": "calc"}}]
    assert resolve_tool_choice(None, tools) == "auto" and forced_prefix("auto") == ""
    assert resolve_tool_choice("none", tools) is None
    assert forced_prefix(resolve_tool_choice("required", tools)) == "<tool_call>\n"
    named = resolve_tool_choice({"type": "function", "function": {"name": "calc"}}, tools)
    assert forced_prefix(named) == '<tool_call>\n{"name": "calc'
    with pytest.raises(ToolError, match="not in tools"):
        resolve_tool_choice({"type": "function", "function": {"name": "other"}}, tools)
    with pytest.raises(ToolError, match="needs tools"):
        resolve_tool_choice("required", None)


def test_unknown_backend_is_named_with_the_known_ones():
    from squall.inference.engines.engine import make_engine
    from squall.shared.config import load_config

    config = load_config(env={})
    object.__setattr__(config.inference, "backend", "tensorrt")  # past the config's own check
    with pytest.raises(ValueError, match="unknown inference backend 'tensorrt'; known backends: torch, vllm"):
        make_engine(config.inference, "/nonexistent")


# --- response rendering (render.py), without a server --------------------------------------


def _reply(**fields):
    from squall.inference.http.render import Reply, TokenTexts

    texts = TokenTexts(lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))
    base = {"meta": {"id": "x", "created": 0, "model": "policy"}, "node": "n1", "prompt_ids": [1, 2],
            "token_texts": texts, "logprobs": True, "return_token_ids": True}  # fmt: skip
    return Reply(**{**base, **fields})


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'


def test_render_chat_choice_parses_tool_calls_only_when_tools_were_offered():
    from squall.inference.engines.engine import Delta
    from squall.inference.http.render import Choice, chat_choice

    c = Choice()
    c.add(
        Delta(
            index=0, token_ids=[3, 4], logprobs=[-0.5, float("-inf")], text="ok " + CALL, finish_reason="stop"
        )
    )
    plain = chat_choice(_reply(), 0, c)
    assert (
        plain["message"] == {"role": "assistant", "content": "ok " + CALL}
        and plain["finish_reason"] == "stop"
    )
    assert [e["logprob"] for e in plain["logprobs"]["content"]] == [-0.5, -1e4]  # -inf is not JSON
    assert [e["token"] for e in plain["logprobs"]["content"]] == ["d", "e"]
    assert (plain["prompt_token_ids"], plain["token_ids"]) == ([1, 2], [3, 4])
    tools = chat_choice(_reply(tool_choice="auto", logprobs=False, return_token_ids=False), 0, c)
    assert tools["finish_reason"] == "tool_calls" and tools["message"]["content"] == "ok"
    (call,) = tools["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "1+1"
    }
    assert tools["logprobs"] is None and "token_ids" not in tools


def test_render_streamed_chat_holds_text_back_until_the_tool_call_ends():
    import asyncio

    from squall.inference.engines.engine import Delta
    from squall.inference.http.render import chat_chunks

    prefix = "<tool_call>\n"
    rest = CALL.removeprefix(prefix)
    deltas = [Delta(index=0, token_ids=[5], logprobs=[-1.0], text=rest[:10], weight_version=7),
              Delta(index=0, token_ids=[6], logprobs=[-2.0], text=rest[10:], finish_reason="stop", weight_version=7)]  # fmt: skip
    counted = []

    async def run():
        async def more():
            yield deltas[1]

        reply = _reply(prefix=prefix, tool_choice="required")
        return [
            c async for c in chat_chunks(reply, deltas[0], more(), include_usage=True, on_done=counted.append)
        ]

    chunks = [json.loads(c.removeprefix(b"data: ")) for c in asyncio.run(run())]
    first, last, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant"}  # text held back
    assert first["choices"][0]["prompt_token_ids"] == [1, 2] and first["weight_version"] == 7
    assert (
        last["choices"][0]["finish_reason"] == "tool_calls" and "prompt_token_ids" not in last["choices"][0]
    )
    assert last["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
    }
    assert counted == [2] and all(c["node"] == "n1" for c in chunks)

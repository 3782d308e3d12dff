"""Gateway pieces without a network: node choice, reply stripping, SSE re-emission."""

from __future__ import annotations

import asyncio
import json

from squall.runner.gateway import Pool, _logprobs_of, _sse, _strip


def test_pool_prefers_up_to_date_then_least_loaded_nodes():
    pool = Pool(["http://a", "http://b/", "http://c"])
    assert pool.pick() == "http://a"  # ties: config order
    pool.inflight["http://a"] = 2
    assert pool.pick() == "http://b"
    assert pool.pick(exclude={"http://b"}) == "http://c"
    pool.versions.update({"http://a": 3, "http://b": 2, "http://c": -1})  # c: not seen yet
    assert pool.pick(min_version=3) == "http://c"  # b is known to be behind; a is busier than c
    pool.inflight["http://c"] = 5
    assert pool.pick(min_version=3) == "http://a"
    assert pool.behind("http://b", 3) and not pool.behind("http://c", 3)


def test_strip_and_logprob_shapes():
    reply = {"weight_version": 3, "node": "n", "prompt_token_ids": [1],
             "choices": [{"message": {"content": "hi"}, "token_ids": [5], "prompt_token_ids": [1],
                          "logprobs": {"content": [{"logprob": -0.5}]}}]}  # fmt: skip
    assert _logprobs_of(reply["choices"][0]["logprobs"]) == [-0.5]
    assert _logprobs_of({"token_logprobs": [-1, -2]}) == [-1.0, -2.0]
    assert _logprobs_of(None) is None
    _strip(reply, keep_logprobs=False)
    assert reply == {"choices": [{"message": {"content": "hi"}, "logprobs": None}]}


def test_sse_chunks_carry_content_tool_calls_finish_and_usage():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = {"id": "x", "created": 1, "model": "m", "usage": {"completion_tokens": 2},
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "tool_calls": [call]},
                          "finish_reason": "tool_calls"}]}  # fmt: skip

    async def collect():
        return [chunk async for chunk in _sse(reply, "chat/completions", include_usage=True)]

    chunks = asyncio.run(collect())
    assert chunks[-1] == b"data: [DONE]\n\n"
    bodies = [json.loads(c[6:]) for c in chunks[:-1]]
    assert bodies[0]["object"] == "chat.completion.chunk"
    assert bodies[0]["choices"][0]["delta"]["content"] == "ok"
    assert bodies[0]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **call}]
    assert bodies[1]["choices"][0]["finish_reason"] == "tool_calls"
    assert bodies[2]["usage"] == {"completion_tokens": 2} and bodies[2]["choices"] == []

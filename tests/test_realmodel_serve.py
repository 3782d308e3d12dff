"""The real pretrained model (SmolLM2-135M-Instruct, tests/realmodel.py) served by a real node:
its own chat template (no tool support: the system-prompt fallback), its own end-of-turn
token, its tool-call format parsed into OpenAI tool_calls, streaming, logprobs, recorded ids."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from inference_helpers import CALC_TOOL, NodeThread, load_model, recompute_logprobs

torch.set_num_threads(1)
pytestmark = [pytest.mark.slow, pytest.mark.realmodel, pytest.mark.timeout(900)]
CONTEXT = 1024
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def node(real_model):
    server = NodeThread(real_model, api_key="sk-test", max_model_len=CONTEXT, max_batch=8).start(
        timeout_s=300
    )
    yield server
    server.stop()


def chat(node, **body):
    body = {"model": "policy", "temperature": 0, "return_token_ids": True, **body}
    response = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": "Bearer sk-test"})  # fmt: skip
    return response


def test_plain_chat_stops_on_im_end_and_ids_decode_to_the_text(node, real_model):
    tokenizer = node.node.engine.tokenizer
    body = chat(node, messages=QUESTION, max_tokens=32, logprobs=True).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert "Paris" in choice["message"]["content"]
    ids = choice["token_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"  # the model's own end of turn
    assert tokenizer.decode(ids[:-1]) == choice["message"]["content"]
    prompt = tokenizer.decode(choice["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    served = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    model = load_model(real_model)
    expected = recompute_logprobs(model, choice["prompt_token_ids"], ids)
    assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < 1e-3


def test_streaming_adds_up_to_the_whole_reply(node):
    whole = chat(node, messages=QUESTION, max_tokens=24).json()["choices"][0]
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": True,
            "return_token_ids": True}  # fmt: skip
    text, ids = "", []
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": "Bearer sk-test"}) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                (item,) = json.loads(line[6:])["choices"]
                text += item["delta"].get("content") or ""
                ids += item["token_ids"]
    assert text == whole["message"]["content"] and ids == whole["token_ids"]


def test_tool_round_trip_in_the_models_own_format(node):
    tokenizer = node.node.engine.tokenizer
    question = [{"role": "user", "content": "Compute 9 * 8 with the calculator."}]
    named = {"type": "function", "function": {"name": "calculator"}}
    first = chat(node, messages=question, tools=[CALC_TOOL], tool_choice=named, max_tokens=40).json()
    (choice,) = first["choices"]
    prompt = tokenizer.decode(choice["prompt_token_ids"])
    assert "<tools>" in prompt and '"calculator"' in prompt  # the fallback put the tools in the system prompt
    assert prompt.endswith('<tool_call>[{"name": "calculator')  # the SmolLM2 list form, prefilled
    assert choice["finish_reason"] == "tool_calls", choice["message"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict)

    messages = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "72"},
    ]
    second = chat(node, messages=messages, tools=[CALC_TOOL], max_tokens=24)
    assert second.status_code == 200, second.text
    prompt = tokenizer.decode(second.json()["choices"][0]["prompt_token_ids"])
    # The call stays in the prompt, in the model's format, and the result follows it.
    rendered = (
        '<tool_call>[{"name": "calculator", "arguments": ' + call["function"]["arguments"] + "}]</tool_call>"
    )
    assert rendered in prompt
    assert "<tool_response>\n72\n</tool_response>" in prompt


def test_prompt_over_the_context_is_refused_naming_the_limit(node):
    long = [{"role": "user", "content": "word " * (CONTEXT + 50)}]
    response = chat(node, messages=long, max_tokens=8)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"context is {CONTEXT} tokens" in error["message"]

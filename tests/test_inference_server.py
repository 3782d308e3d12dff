"""The inference server end to end: a real uvicorn server on a free port, the real tiny
model, the official openai SDK. Logprobs are checked against a plain forward pass."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
import torch
from inference_helpers import (
    API_KEY,
    CHAT_MESSAGES,
    NodeThread,
    assert_logprobs_match,
    check_completions_contract,
    check_n_choices_differ_and_a_seed_repeats_them,
    check_streaming_contract,
    load_model,
    response_text,
)
from transformers import AutoTokenizer

from squall.inference.tiny import build_tiny_model

torch.set_num_threads(1)
MESSAGES = CHAT_MESSAGES


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def node(tiny_dir):
    server = NodeThread(tiny_dir, api_key=API_KEY, max_batch=16).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


def test_chat_returns_token_ids_logprobs_version_and_node(node, model, tokenizer):
    raw = node.client().chat.completions.with_raw_response.create(
        model="policy", messages=MESSAGES, max_tokens=24, logprobs=True, extra_body={"return_token_ids": True}
    )
    assert raw.headers["x-squall-weight-version"] == "0"
    r = raw.parse()
    extra = r.model_extra
    assert extra["weight_version"] == 0 and extra["node"] == node.node.node
    choice = r.choices[0]
    prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert 1 <= len(token_ids) <= 24
    assert choice.message.content == response_text(tokenizer, token_ids, choice.finish_reason)
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert_logprobs_match(model, prompt_ids, token_ids, logprobs)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(token_ids)


def test_n_choices_differ_and_a_seed_repeats_them(node):
    check_n_choices_differ_and_a_seed_repeats_them(node.client())


def test_streaming_delivers_the_same_contract(node, model, tokenizer):
    check_streaming_contract(node.client(), model, tokenizer)


def test_concurrent_requests_are_batched_and_stay_exact(node, model):
    client = node.client()
    prompts = [[{"role": "user", "content": "count " * (1 + 5 * i)}] for i in range(8)]
    scrape = lambda: {  # noqa: E731
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(f"{node.url}/metrics").text.splitlines()
        if line.startswith("squall_inference_") and " " in line
    }
    before = scrape()

    def ask(messages):
        r = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=32, logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        c = r.choices[0]
        return (
            c.model_extra["prompt_token_ids"],
            c.model_extra["token_ids"],
            [e.logprob for e in c.logprobs.content],
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, prompts))
    for prompt_ids, token_ids, logprobs in results:
        assert len(token_ids) == 32  # ignore_eos
        assert_logprobs_match(model, prompt_ids, token_ids, logprobs)
    after = scrape()
    forwards = (
        after["squall_inference_forward_passes_total"] - before["squall_inference_forward_passes_total"]
    )
    tokens = after["squall_inference_batched_tokens_total"] - before["squall_inference_batched_tokens_total"]
    assert tokens == 8 * 32
    assert tokens / forwards > 2  # sequences shared forward passes


def test_completions_with_token_ids_and_stop_strings(node, model, tokenizer):
    check_completions_contract(node.client(), model, tokenizer)


BAD_REQUESTS = [
    (dict(model="gpt-9"), 404, "model 'gpt-9' is not served here"),
    (dict(temperature=3), 400, "temperature"),
    (dict(top_p=0), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=5000), 400, "max_tokens"),
    (dict(n=99), 400, "n is 99"),
    (dict(messages=[{"role": "user", "content": "x " * 3000}]), 400, "context is 1024 tokens"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    (dict(messages=[]), 400, "messages"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), 400, "tools[0].function.name"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), 400, "parameters"),
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool_choice"),
    (dict(presence_penalty=1.0), 400, "presence_penalty is not supported"),
]


@pytest.mark.parametrize(("fields", "status", "message"), BAD_REQUESTS)
def test_bad_requests_get_4xx_naming_the_problem(node, fields, status, message):
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4, **fields}
    r = httpx.post(
        f"{node.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    ok = node.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")  # still serving


def test_invalid_json_and_missing_key(node):
    auth = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    r = httpx.post(f"{node.url}/v1/chat/completions", content=b'{"model": "policy",', headers=auth)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        node.client(api_key="wrong").chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
    r = httpx.post(f"{node.url}/v1/completions", json={"model": "policy", "prompt": [99999]}, headers=auth)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    assert node.client().completions.create(model="policy", prompt="hi", max_tokens=2).choices


def test_models_health_and_metrics(node):
    assert [m.id for m in node.client().models.list().data] == ["policy"]
    assert httpx.get(f"{node.url}/health").json() == {
        "status": "ok",
        "weight_version": 0,
        "node": node.node.node,
    }
    text = httpx.get(f"{node.url}/metrics").text
    assert 'squall_inference_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert "squall_inference_weight_version 0.0" in text
    assert 'squall_weight_version{role="served"} 0.0' in text  # the standard name too


def test_a_client_that_leaves_frees_its_batch_slot(node):
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    before = scrape(node)["squall_inference_batched_tokens_total"]
    with pytest.raises(httpx.TimeoutException):
        # Leave after 0.1 s: 900 tokens take ~0.5 s on a quiet 2-core machine, and the server
        # notices a gone client within 0.25 s, so the request must still be decoding by then.
        httpx.post(f"{node.url}/v1/chat/completions", json=body, headers=headers, timeout=0.1)
    deadline = time.monotonic() + 10
    while scrape(node)["squall_inference_running_sequences"] > 0:
        assert time.monotonic() < deadline, "the abandoned request kept decoding"
        time.sleep(0.05)
    assert scrape(node)["squall_inference_batched_tokens_total"] - before < 900  # stopped early
    assert node.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2).choices


def scrape(node) -> dict[str, float]:
    return {
        line.split()[0]: float(line.split()[1])
        for line in httpx.get(f"{node.url}/metrics").text.splitlines()
        if line.startswith("squall_inference_") and " " in line
    }

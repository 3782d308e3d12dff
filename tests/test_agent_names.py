"""Agent names go into URLs (`/a/{token}/agent/{name}/v1`), so each is checked where it enters:
the run config, `llm.agent_url`, and the runner's real gateway (uvicorn on loopback), which
answers a name that is not one URL segment with an error saying so — not a bare 404. Also: a
frozen endpoint that is down is named, with its field, in the agent's 502."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from inference_helpers import free_port
from test_opponents import MESSAGES, IndependentEndpoint, _run_gateway

from squall.runner.agents import LLM
from squall.shared.config import AGENT_NAME_RULE, RunnerSection, load_config
from squall.shared.errors import ConfigError

BAD_NAMES = ["team/a", "a?b", "", "a b", "..", "-x"]


@pytest.mark.parametrize("field", ["train_agents", "seats"])
@pytest.mark.parametrize("name", BAD_NAMES)
def test_config_refuses_an_agent_name_that_is_not_one_url_segment(field, name):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides={"runner": {field: [name]}}, env={})
    message = str(caught.value)
    assert f"runner.{field}: agent name {name!r} is not valid" in message and AGENT_NAME_RULE in message


def test_config_keeps_ordinary_names_and_refuses_an_empty_frozen_model_name():
    config = load_config(None, overrides={"runner": {"seats": ["seat1", "red.2", "w_x-y"]}}, env={})
    assert config.runner.seats == ["seat1", "red.2", "w_x-y"]
    with pytest.raises(ConfigError, match="runner.frozen_models has an empty model name"):
        load_config(None, overrides={"runner": {"frozen_models": {"": "http://127.0.0.1:1"}}}, env={})


@pytest.mark.parametrize("name", BAD_NAMES)
def test_agent_url_refuses_a_bad_name(name):
    llm = LLM(
        base_url="http://127.0.0.1:1/a/t/v1", model="policy", api_key="k", _root="http://127.0.0.1:1/a/t"
    )
    with pytest.raises(ValueError, match="llm.agent_url: agent name") as caught:
        llm.agent_url(name)
    assert AGENT_NAME_RULE in str(caught.value)
    assert llm.agent_url("judge-1") == "http://127.0.0.1:1/a/t/agent/judge-1/v1"


def test_gateway_explains_a_bad_agent_name_in_the_url():
    judge = IndependentEndpoint()
    section = RunnerSection(inference_urls=[judge.url], frozen_models={"referee": judge.url})

    async def body(gateway):
        attempt = gateway.open("g1:0#0")
        root = gateway.base_url(attempt.token).removesuffix("/v1")
        request = {"model": "referee", "messages": MESSAGES}
        replies = {}
        async with httpx.AsyncClient(timeout=10) as client:
            for name in ("team/a", "a?b", "", "a%20b", "judge-1"):
                reply = await client.post(f"{root}/agent/{name}/v1/chat/completions", json=request)
                replies[name] = (reply.status_code, reply.json())
            stray = await client.get(f"{root}/v2/models")
        return replies, (stray.status_code, stray.json())

    try:
        replies, stray = asyncio.run(_run_gateway(section, body))
    finally:
        judge.stop()
    for name, shown in (("team/a", "team/a"), ("a?b", "a?b"), ("", "")):
        status, reply = replies[name]
        message = reply["error"]["message"]
        assert status == 404 and reply["error"]["type"] == "invalid_request_error", (name, reply)
        assert f"the agent name here reads {shown!r}" in message and AGENT_NAME_RULE in message, message
    status, reply = replies["a%20b"]  # one segment, decoded by the router to 'a b': refused by the name rule
    assert status == 400 and "agent name 'a b' is not valid" in reply["error"]["message"]
    status, reply = replies["judge-1"]
    assert status == 200 and reply["choices"][0]["message"]["content"] == "judge referee says ok"
    assert stray[0] == 404 and "the gateway serves /a/TOKEN/v1/" in stray[1]["error"]["message"]


def test_a_frozen_endpoint_that_is_down_is_named_with_its_field_while_the_policy_is_up():
    policy = IndependentEndpoint()  # up: the failure must not be blamed on runner.inference_urls
    down = f"http://127.0.0.1:{free_port()}"
    section = RunnerSection(inference_urls=[policy.url], frozen_models={"referee": down}, upstream_retries=1)

    async def body(gateway):
        attempt = gateway.open("g1:0#0")
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.post(f"{gateway.base_url(attempt.token, 'judge')}/chat/completions",
                                     json={"model": "referee", "messages": MESSAGES})  # fmt: skip

    try:
        reply = asyncio.run(_run_gateway(section, body))
    finally:
        policy.stop()
    message = reply.json()["error"]["message"]
    assert reply.status_code == 502 and reply.json()["error"]["type"] == "upstream_unavailable"
    assert f"frozen model 'referee' in runner.frozen_models ({down}/v1) is up" in message, message
    assert f"{down}/v1: ConnectError" in message and "runner.inference_urls" not in message
    assert policy.requests == []

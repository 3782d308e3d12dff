"""Real agents for the gateway tests: the official openai SDK and LangGraph, unchanged apart
from the base URL. Each writes what it sent and what it got back to `task["record"]`, so the
test can compare that conversation with the token ids the gateway recorded."""

from __future__ import annotations

import json

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _squall_fields(reply: dict) -> list[str]:
    """squall's own fields, if any leaked into what the agent got."""
    names = ("weight_version", "node", "prompt_token_ids", "token_ids")
    return [n for n in names if n in reply] + [n for n in names if n in reply["choices"][0]]


def _save(task: dict, calls: list[dict]) -> None:
    with open(task["record"], "w") as handle:
        json.dump({"calls": calls}, handle)


async def openai_chat(task: dict, llm) -> float:
    """Two turns of plain chat with the openai SDK."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": task["question"]},
    ]
    calls = []
    for follow_up in ("Say more.", None):
        reply = await client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=12, seed=1
        )
        choice = reply.choices[0]
        calls.append({"messages": list(messages), "content": choice.message.content,
                      "finish_reason": choice.finish_reason, "logprobs": choice.logprobs is not None,
                      "extra": _squall_fields(reply.model_dump())})  # fmt: skip
        messages = [*messages, {"role": "assistant", "content": choice.message.content}]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    _save(task, calls)
    return 1.0


async def openai_tools(task: dict, llm) -> float:
    """Tool calling with the openai SDK: tools offered, a past call and its result in the
    history, then one streamed call (the gateway re-emits it as SSE chunks)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]  # fmt: skip
    calls = []
    reply = await client.chat.completions.create(
        model=llm.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=10
    )
    calls.append({"messages": messages, "tools": [WEATHER_TOOL], "content": reply.choices[0].message.content,
                  "finish_reason": reply.choices[0].finish_reason})  # fmt: skip
    stream = await client.chat.completions.create(
        model=llm.model, messages=messages, tools=[WEATHER_TOOL], max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    parts, finish, usage = [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    calls.append({"messages": messages, "tools": [WEATHER_TOOL], "content": "".join(parts), "finish_reason": finish,
                  "usage": usage.model_dump() if usage else None})  # fmt: skip
    # Completions API too, through the same attempt.
    legacy = await client.completions.create(model=llm.model, prompt="2+2=", max_tokens=4)
    calls.append(
        {
            "prompt": "2+2=",
            "content": legacy.choices[0].text,
            "finish_reason": legacy.choices[0].finish_reason,
        }
    )
    _save(task, calls)
    return 0.5


async def langgraph_react(task: dict, llm) -> float:
    """A LangGraph ReAct agent with one tool, pointed at the gateway."""
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI
    from langchain_openai.chat_models.base import _convert_message_to_dict
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "sunny"

    model = ChatOpenAI(
        base_url=llm.base_url, api_key=llm.api_key, model=llm.model, max_tokens=10, max_retries=0
    )
    graph = create_react_agent(model, [get_weather])
    state = await graph.ainvoke({"messages": [{"role": "user", "content": task["question"]}]})
    messages = [_convert_message_to_dict(m) for m in state["messages"]]
    final = messages[-1]
    _save(task, [{"messages": messages[:-1], "tools": [convert_to_openai_tool(get_weather)],
                  "content": final["content"], "finish_reason": None}])  # fmt: skip
    return 1.0


async def multi_agent(task: dict, llm) -> float:
    """A trained player, an untrained opponent (named agent) and a frozen judge model."""
    from openai import AsyncOpenAI

    player = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    opponent = AsyncOpenAI(base_url=llm.agent_url("opponent"), api_key=llm.api_key)
    ask = [{"role": "user", "content": "move?"}]
    await player.chat.completions.create(model=llm.model, messages=ask, max_tokens=4)
    await opponent.chat.completions.create(model=llm.model, messages=ask, max_tokens=4)
    await player.chat.completions.create(model="judge", messages=ask, max_tokens=4)
    models = await player.models.list()
    return float(len(models.data))


async def needs_inference(task: dict, llm) -> float:
    """One call; any error (after the gateway's retries) propagates and fails the attempt."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    return 1.0

"""Agents for the gateway's protocol tests: the official `anthropic` SDK (Messages) and the
`openai` SDK's Responses API, unchanged apart from the base URL. Each writes what it sent and
what it got back to `task["record"]`; the test compares that with the Turns the gateway
recorded."""

from __future__ import annotations

import asyncio
import json

import httpx

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSES_WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": WEATHER["input_schema"],
}
# Anthropic's current SDK no longer takes temperature as an argument; the API field still exists.
GREEDY = {"temperature": 0}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in RESPONSES_WEATHER.items() if k != "type"},
}


def anthropic_url(llm, agent: str | None = None) -> str:
    """The Anthropic SDK adds /v1/messages itself: its base URL is the attempt's without /v1."""
    return (llm.agent_url(agent) if agent else llm.base_url).removesuffix("/v1")


def _save(task: dict, calls: list[dict]) -> None:
    with open(task["record"], "w") as handle:
        json.dump({"calls": calls}, handle)


def _blocks(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


async def messages_plain(task: dict, llm) -> float:
    """Two turns with the sync client (run in a thread), then one streamed with the async one."""
    import anthropic

    sync = anthropic.Anthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    history = [{"role": "user", "content": task["question"]}]
    calls = []
    for follow_up in ("Say more.", None):
        reply = await asyncio.to_thread(
            sync.messages.create, model=llm.model, system="You are terse.", messages=history, max_tokens=12
        )
        calls.append({"system": "You are terse.", "messages": list(history), "content": _blocks(reply),
                      "stop_reason": reply.stop_reason, "usage": reply.usage.model_dump()})  # fmt: skip
        history = [*history, {"role": "assistant", "content": _blocks(reply) or ""}]
        if follow_up:
            history.append({"role": "user", "content": [{"type": "text", "text": follow_up}]})
    client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    events, texts = [], []
    async with client.messages.stream(
        model=llm.model, system="You are terse.", messages=history[:1], max_tokens=12
    ) as stream:
        async for event in stream:
            events.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                texts.append(event.delta.text)
        final = await stream.get_final_message()
    calls.append({"system": "You are terse.", "messages": history[:1], "streamed": "".join(texts),
                  "events": events, "content": _blocks(final), "stop_reason": final.stop_reason})  # fmt: skip
    _save(task, calls)
    return 1.0


async def messages_tools(task: dict, llm) -> float:
    """Tools offered, a tool_use / tool_result round trip in the history, the same conversation
    as a Chat Completions request, then a forced tool call streamed."""
    import anthropic
    from openai import AsyncOpenAI

    client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}]},
    ]  # fmt: skip
    calls = []
    reply = await client.messages.create(
        model=llm.model, system="Use tools.", messages=history, tools=[WEATHER], max_tokens=10,
        stop_sequences=["\n\n"],
    )  # fmt: skip
    calls.append({"content": _blocks(reply), "stop_reason": reply.stop_reason,
                  "stop_sequence": reply.stop_sequence})  # fmt: skip
    chat = AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
    same = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"},
    ]  # fmt: skip
    await chat.chat.completions.create(
        model=llm.model, messages=same, tools=[CHAT_WEATHER], max_tokens=10, stop=["\n\n"]
    )
    calls.append({"messages": same, "tools": [CHAT_WEATHER]})
    forced = [{"role": "user", "content": "Weather in Oslo?"}]
    async with client.messages.stream(
        model=llm.model, messages=forced, tools=[WEATHER], max_tokens=40,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:  # fmt: skip
        events = [event.type async for event in stream]
        final = await stream.get_final_message()
    calls.append({"events": events, "content": _blocks(final), "stop_reason": final.stop_reason})
    _save(task, calls)
    return 1.0


async def messages_agents(task: dict, llm) -> float:
    """Two named agents on their own URLs, one call each."""
    import anthropic

    for name in ("alice", "bob"):
        client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm, name), api_key="dummy", max_retries=0)
        await client.messages.create(
            model=llm.model, messages=[{"role": "user", "content": f"I am {name}"}], max_tokens=4
        )
    return 1.0


async def responses_plain(task: dict, llm) -> float:
    """instructions + a string input, then a follow-up by previous_response_id (sync), then the
    same streamed (async)."""
    from openai import AsyncOpenAI, OpenAI

    sync = OpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
    first = await asyncio.to_thread(
        sync.responses.create, model=llm.model, instructions="You are terse.", input=task["question"],
        max_output_tokens=12,
    )  # fmt: skip
    second = await asyncio.to_thread(
        sync.responses.create, model=llm.model, instructions="You are terse.", previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Say more."}]}], max_output_tokens=12,
    )  # fmt: skip
    calls = [
        {"text": r.output_text, "status": r.status, "usage": r.usage.model_dump()} for r in (first, second)
    ]
    client = AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
    stream = await client.responses.create(
        model=llm.model,
        instructions="You are terse.",
        input=task["question"],
        max_output_tokens=12,
        stream=True,
    )
    events, texts, final = [], [], None
    async for event in stream:
        events.append(event.type)
        if event.type == "response.output_text.delta":
            texts.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    calls.append({"streamed": "".join(texts), "events": events, "text": final.output_text})
    _save(task, calls)
    return 1.0


async def responses_tools(task: dict, llm) -> float:
    """A function_call / function_call_output round trip in the input, then a forced call streamed,
    then its output sent back by previous_response_id."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"},
    ]
    reply = await client.responses.create(
        model=llm.model, input=items, tools=[RESPONSES_WEATHER], max_output_tokens=10
    )
    calls = [{"output": [o.model_dump() for o in reply.output]}]
    stream = await client.responses.create(
        model=llm.model, input="Weather in Oslo?", tools=[RESPONSES_WEATHER], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True,
    )  # fmt: skip
    events, final = [], None
    async for event in stream:
        events.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    output = [o.model_dump() for o in final.output]
    calls.append({"events": events, "output": output})
    answered = [
        {"type": "function_call_output", "call_id": o["call_id"], "output": "cloudy"}
        for o in output
        if o["type"] == "function_call"
    ]
    follow = await client.responses.create(
        model=llm.model, previous_response_id=final.id, input=answered or "ok?", tools=[RESPONSES_WEATHER],
        max_output_tokens=6,
    )  # fmt: skip
    calls.append({"text": follow.output_text, "answered": len(answered)})
    _save(task, calls)
    return 1.0


async def bad_requests(task: dict, llm) -> float:
    """Every refused request of both protocols, then one good call each: the gateway stays up."""
    import anthropic
    from openai import AsyncOpenAI, BadRequestError

    base = llm.base_url
    got: dict[str, dict] = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for name, path, body in (
            ("messages_malformed", "messages", b'{"model": "m", "messages": ['),
            ("responses_malformed", "responses", b'{"model": "m", "input": '),
            # The SDK checks max_tokens itself; a raw client (or another SDK) may leave it out.
            ("no_max_tokens", "messages", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'),
        ):
            reply = await http.post(
                f"{base}/{path}", content=body, headers={"content-type": "application/json"}
            )
            got[name] = {"status": reply.status_code, "body": reply.json()}
    client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    bad_messages = {
        "unknown_block": {"messages": [{"role": "user", "content": [{"type": "hologram", "data": 1}]}], "max_tokens": 4},
        "unknown_tool_id": {"messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}],
            "max_tokens": 4},
    }  # fmt: skip
    for name, kwargs in bad_messages.items():
        try:
            await client.messages.create(model=llm.model, **kwargs)
            got[name] = {"status": 200}
        except anthropic.APIStatusError as exc:
            got[name] = {"status": exc.status_code, "body": exc.body}
    responses = AsyncOpenAI(base_url=base, api_key="dummy", max_retries=0)
    bad_responses = {
        "unknown_item": {"input": [{"type": "hologram"}]},
        "unknown_call_id": {
            "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]
        },
        "unknown_previous": {"input": "hi", "previous_response_id": "resp_nope"},
    }
    for name, kwargs in bad_responses.items():
        try:
            await responses.responses.create(model=llm.model, max_output_tokens=4, **kwargs)
            got[name] = {"status": 200}
        except BadRequestError as exc:
            got[name] = {"status": exc.status_code, "body": exc.body}
    ok = await client.messages.create(
        model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    again = await responses.responses.create(model=llm.model, input="hi", max_output_tokens=3)
    got["alive"] = {"messages": ok.stop_reason, "responses": again.status}
    _save(task, [got])
    return 1.0


async def overflow(task: dict, llm) -> float:
    """A prompt longer than the model's context, by the protocol named in the task."""
    import anthropic
    from openai import AsyncOpenAI, BadRequestError

    long = "word " * task["words"]
    try:
        if task["protocol"] == "messages":
            client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
            await client.messages.create(
                model=llm.model, system=long, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        else:
            client = AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
            await client.responses.create(model=llm.model, instructions=long, input="hi", max_output_tokens=4)
        got = {"status": 200}
    except (anthropic.APIStatusError, BadRequestError) as exc:
        got = {"status": exc.status_code, "body": exc.body}
    _save(task, [got])
    return 1.0  # the agent carries on; the gateway fails the attempt with the reason


async def messages_calculator(task: dict, llm) -> float:
    """The taught model's conversation by Messages: it calls `calculator` (a tool_use block), gets
    the tool_result, answers; then the first call again, streamed."""
    import anthropic
    from inference_helpers import CALC_TOOL, TOOL_QUESTION

    function = CALC_TOOL["function"]
    tool = {
        "name": function["name"],
        "description": function["description"],
        "input_schema": function["parameters"],
    }
    client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    first = await client.messages.create(
        model=llm.model, messages=TOOL_QUESTION, tools=[tool], max_tokens=48, extra_body=GREEDY
    )
    uses = [b for b in first.content if b.type == "tool_use"]
    history = [
        *TOOL_QUESTION,
        {"role": "assistant", "content": _blocks(first)},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "84"} for u in uses],
        },
    ]
    second = await client.messages.create(
        model=llm.model, messages=history, tools=[tool], max_tokens=24, extra_body=GREEDY
    )
    async with client.messages.stream(
        model=llm.model, messages=TOOL_QUESTION, tools=[tool], max_tokens=48, extra_body=GREEDY
    ) as stream:
        events = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    calls = [
        {"content": _blocks(m), "stop_reason": m.stop_reason, "usage": m.usage.model_dump()}
        for m in (first, second, streamed)
    ]
    calls[2]["events"] = events
    _save(task, calls)
    return 1.0


async def responses_calculator(task: dict, llm) -> float:
    """The taught model's conversation by Responses: a function_call item, its output sent back
    by previous_response_id, the answer; then the first call again, streamed."""
    from inference_helpers import CALC_TOOL, TOOL_QUESTION
    from openai import AsyncOpenAI

    tool = {"type": "function", **CALC_TOOL["function"]}
    client = AsyncOpenAI(base_url=llm.base_url, api_key="dummy", max_retries=0)
    first = await client.responses.create(
        model=llm.model, input=TOOL_QUESTION, tools=[tool], max_output_tokens=48, temperature=0
    )
    outputs = [
        {"type": "function_call_output", "call_id": o.call_id, "output": "84"}
        for o in first.output
        if o.type == "function_call"
    ]
    second = await client.responses.create(
        model=llm.model, previous_response_id=first.id, input=outputs, tools=[tool], max_output_tokens=24,
        temperature=0,
    )  # fmt: skip
    stream = await client.responses.create(
        model=llm.model, input=TOOL_QUESTION, tools=[tool], max_output_tokens=48, temperature=0, stream=True
    )
    events, final, arguments = [], None, []
    async for event in stream:
        events.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    calls = [
        {"output": [o.model_dump() for o in r.output], "text": r.output_text} for r in (first, second, final)
    ]
    calls[2].update(events=events, arguments="".join(arguments))
    _save(task, calls)
    return 1.0


async def rewrites_history(task: dict, llm) -> float:
    """Two Messages calls where the second sends back an edited first reply: the gateway must
    see that its prompt no longer extends the first call's prompt + response."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=anthropic_url(llm), api_key="dummy", max_retries=0)
    history = [{"role": "user", "content": "Count to three."}]
    first = await client.messages.create(model=llm.model, messages=history, max_tokens=8)
    # Edited at its start: a suffix would still extend a reply cut off at max_tokens (no end token
    # between the sampled text and the edit), and CI once sampled exactly that.
    edited = "(edited) " + "".join(b.text for b in first.content if b.type == "text")
    history += [{"role": "assistant", "content": edited}, {"role": "user", "content": "Again."}]
    await client.messages.create(model=llm.model, messages=history, max_tokens=8)
    return 1.0

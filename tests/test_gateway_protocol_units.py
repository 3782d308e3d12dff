"""The protocol translations without a network: Messages and Responses requests -> the chat body,
chat replies -> the protocol's body and its stream events, and the protocol-shaped refusals."""

from __future__ import annotations

import asyncio
import json

import pytest

from squall.runner.protocols import ProtocolError, anthropic_messages, matched_stop, openai_responses

WEATHER_CALL = {"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}


def chat_reply(message: dict, finish: str = "stop", tokens: list[str] | None = None) -> dict:
    logprobs = {"content": [{"token": t, "logprob": -1.0} for t in tokens or []]}
    return {"model": "policy", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "logprobs": logprobs}]}  # fmt: skip


def collect(stream) -> list[tuple[str, dict]]:
    async def run():
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(run()):
        head, data = chunk.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_messages_request_becomes_the_equivalent_chat_request():
    body = {
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["##"],
        "tools": [{"name": "w", "description": "weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"}, "stream": True,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sun"}]},
                                         {"type": "text", "text": "And now?"}]},
        ],
    }  # fmt: skip
    chat, stream = anthropic_messages.to_chat(body)
    assert stream is True
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [WEATHER_CALL],
            "reasoning_content": "hm",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sun"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "description": "weather",
                                                               "parameters": {"type": "object"}}}]  # fmt: skip
    assert list(chat["tools"][0]["function"]) == ["name", "description", "parameters"]  # OpenAI's order
    assert chat["tool_choice"] == "required" and chat["stop"] == ["##"] and chat["max_tokens"] == 9


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content.0.type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
         "messages.0.content.0.tool_use_id"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305"}]},
         "tools.0"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
         "tool_choice.type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "top_k": 5}, "top_k"),
    ],
)  # fmt: skip
def test_messages_refusals_name_the_field(body, field):
    with pytest.raises(ProtocolError) as caught:
        anthropic_messages.to_chat(body)
    assert caught.value.message.startswith(f"{field}:"), caught.value.message
    response = anthropic_messages.error(400, caught.value.message)
    payload = json.loads(response.body)
    assert payload == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": caught.value.message},
    }


def test_messages_reply_blocks_stop_reasons_and_events():
    reply = chat_reply({"content": "Checking.", "tool_calls": [WEATHER_CALL]}, "tool_calls")
    message = anthropic_messages.from_chat(reply, "claude-x", [])
    assert message["content"] == [{"type": "text", "text": "Checking."},
                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}}]  # fmt: skip
    assert message["stop_reason"] == "tool_use" and message["model"] == "claude-x"
    assert message["usage"]["input_tokens"] == 7 and message["usage"]["output_tokens"] == 3
    events = collect(anthropic_messages.events(message))
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None
    assert events[5][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}
    assert events[7][1]["delta"]["stop_reason"] == "tool_use" and events[7][1]["usage"] == {
        "output_tokens": 3
    }
    # A stop string: found in the sampled tokens' text, named in stop_sequence.
    cut = chat_reply({"content": "a"}, "stop", tokens=["a", "#", "#"])
    stopped = anthropic_messages.from_chat(cut, "m", ["##", "zz"])
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "##"
    eos = chat_reply({"content": "a"}, "stop", tokens=["a", "<|im_end|>"])
    assert matched_stop(eos["choices"][0], ["##"]) is None
    assert (
        anthropic_messages.from_chat(chat_reply({"content": "a"}, "length"), "m", [])["stop_reason"]
        == "max_tokens"
    )


def test_responses_input_items_previous_response_and_stream():
    store: dict = {}
    body = {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 5,
        "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "t1", "name": "w", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "t1", "output": "sun"},
        ],
    }  # fmt: skip
    chat, history = openai_responses.to_chat(body, store)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert (
        chat["messages"][1:]
        == history
        == [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL], "reasoning_content": "hm"},
            {"role": "tool", "tool_call_id": "t1", "content": "sun"},
        ]
    )
    assert chat["max_tokens"] == 5 and chat["tools"][0]["function"]["name"] == "w"
    response = openai_responses.from_chat(chat_reply({"content": "Sunny."}), body)
    assert [o["type"] for o in response["output"]] == ["message"] and response["status"] == "completed"
    store[response["id"]] = [*history, *openai_responses._as_chat(response["output"])]
    follow, _ = openai_responses.to_chat({"previous_response_id": response["id"], "input": "More?"}, store)
    assert follow["messages"][-2:] == [
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "More?"},
    ]
    assert follow["messages"][0] == {
        "role": "system",
        "content": "Use tools.",
    }  # instructions not carried over
    events = collect(openai_responses.events(response))
    names = [name for name, _ in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    cut = openai_responses.from_chat(chat_reply({"tool_calls": [WEATHER_CALL]}, "length"), body)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in cut["output"]] == ["function_call"] and cut["output"][0]["call_id"] == "t1"
    assert collect(openai_responses.events(cut))[-1][0] == "response.incomplete"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "input_image"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tools": ["web_search"]}, "tools[0]"),
    ],
)
def test_responses_refusals_name_the_field(body, param):
    with pytest.raises(ProtocolError) as caught:
        openai_responses.to_chat(body, {})
    assert caught.value.param == param and caught.value.message.startswith(param), caught.value.message


def test_responses_namespace_tools_are_flattened_and_hosted_tools_left_out():
    function = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    tools = [{"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "ns", "tools": [function]}, {**function, "name": "g"}]  # fmt: skip
    chat, _ = openai_responses.to_chat({"input": "x", "tools": tools}, {})
    assert [t["function"]["name"] for t in chat["tools"]] == ["f", "g"]


def test_continuity_marks_extends_and_finds_the_first_difference():
    from squall.runner.continuity import mark_last
    from squall.shared.schemas import Turn, pack_logprobs, pack_tokens

    def turn(prompt, response, agent="main", trained=True):
        return Turn(agent=agent, model="m", trained=trained, prompt_ids=pack_tokens(prompt),
                    response_ids=pack_tokens(response), response_logprobs=pack_logprobs([-1.0] * len(response)),
                    version=0)  # fmt: skip

    turns = [turn([1, 2], [3, 4])]
    assert mark_last(turns) is None and turns[0].extends is None  # first call: nothing to extend
    turns.append(turn([9], [9], agent="other"))
    assert mark_last(turns) is None and turns[1].extends is None  # another agent's first call
    turns.append(turn([1, 2, 3, 4, 5], [6]))
    assert mark_last(turns) is None and turns[2].extends is True
    turns.append(turn([1, 2, 3, 4, 7, 6, 8], [1]))  # the previous reply re-rendered differently
    assert mark_last(turns) == (4, 6) and turns[3].extends is False
    turns.append(turn([0], [1], trained=False))
    assert mark_last(turns) is None and turns[4].extends is None  # untrained calls are not marked

"""OpenAI Responses (`POST .../v1/responses`) on the gateway.

Request -> chat completions:
- `instructions` -> the system message (not carried over by `previous_response_id`, as OpenAI
  does);
- `input`: a string (one user message) or items: messages (`role` user / system / developer /
  assistant, content a string or `input_text` / `output_text` parts), `function_call` (->
  an assistant tool call) and `function_call_output` (-> a `tool` message, which must answer a
  call_id seen before), `reasoning` (-> the next assistant message's reasoning_content);
- `previous_response_id`: the conversation that response ended (its input and output) goes
  first; ids are remembered for the attempt only (this attempt's URL, any agent);
- `tools` of type function (`name`, `description`, `parameters`) and `tool_choice`;
- `max_output_tokens`, `temperature`, `top_p`.

Reply: reasoning -> a `reasoning` item, content -> a `message` item with one `output_text`
part, each tool call -> a `function_call` item; status `incomplete` with reason
`max_output_tokens` when the reply was cut by the length limit. `stream: true` sends the
Responses events (response.created, response.in_progress, per item output_item.added,
content_part.added / output_text.delta / .done / content_part.done or
function_call_arguments.delta / .done, output_item.done, then response.completed or
response.incomplete), each with its `sequence_number`. Errors keep OpenAI's error shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from . import ProtocolError, chat_result, decode_body, error_message, json_response, sse_event, text_of

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")
SAMPLING = ("temperature", "top_p")
STORE_KEY = "responses"  # in the attempt's protocol_state: response id -> its whole conversation


async def handle(request: Request, call: Any) -> Response:
    """One Responses request: `call` is the gateway's ProtocolCall."""
    if call.state is None:
        return error(404, "this attempt is over (or never existed): its base URL is no longer served")
    store: dict[str, list[dict[str, Any]]] = call.state.setdefault(STORE_KEY, {})
    try:
        body = decode_body(await request.body())
        chat, history = to_chat(body, store)
    except ProtocolError as exc:
        return error(exc.status, exc.message, exc.param)
    status, reply = chat_result(await call.forward(chat))
    if status != 200:
        message, param, code = error_message(reply)
        return error(status, message, param, code)
    response = from_chat(reply, body)
    store[response["id"]] = [*history, *_as_chat(response["output"])]
    if body.get("stream"):
        return StreamingResponse(events(response), media_type="text/event-stream")
    return json_response(response)


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


# --- request ------------------------------------------------------------------------------


def to_chat(body: dict[str, Any], store: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], list]:
    """(the chat-completions body, the conversation without instructions to remember)."""
    history: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in store:
            raise ProtocolError(
                400,
                f"previous_response_id: no response {previous!r} in this attempt; "
                "ids are kept only for the attempt that made them",
                "previous_response_id",
            )
        history = list(store[previous])
    history += _items(body.get("input"), _call_ids(history))
    if not history:
        raise ProtocolError(400, "input: is empty; send a string or a list of input items", "input")
    messages = list(history)
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise ProtocolError(400, "instructions: must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ProtocolError(
                400, f"max_output_tokens: must be an integer >= 1, got {limit!r}", "max_output_tokens"
            )
        chat["max_tokens"] = limit
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    for name in SAMPLING:
        if body.get(name) is not None:
            chat[name] = body[name]
    return chat, history


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or []}


def _items(value: Any, call_ids: set[str]) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError(400, "input: must be a string or a list of input items", "input")
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(400, f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            call_ids.add(call["id"])
            if out and out[-1]["role"] == "assistant":  # text then calls, or parallel calls: one turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, where, call_ids))
        elif kind == "reasoning":
            reasoning += [str(s.get("text", "")) for s in item.get("summary") or [] if isinstance(s, dict)]
            continue
        else:
            raise ProtocolError(
                400,
                f"{where}.type: {kind!r} is not an input item squall serves; use "
                "message, function_call, function_call_output or reasoning",
                f"{where}.type",
            )
        if reasoning and out[-1]["role"] == "assistant":  # reasoning belongs to the turn after it
            out[-1]["reasoning_content"], reasoning = "".join(reasoning), []
    return out


def _call_output(item: dict[str, Any], where: str, call_ids: set[str]) -> dict[str, Any]:
    call_id = item.get("call_id")
    if call_id not in call_ids:
        raise ProtocolError(
            400,
            f"{where}.call_id: {call_id!r} answers no function_call item before it "
            f"(known call ids: {', '.join(sorted(call_ids)) or 'none'})",
            f"{where}.call_id",
        )
    output = item.get("output", "")
    text = output if isinstance(output, str) else _text(output, f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise ProtocolError(
            400, f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role"
        )
    text = _text(item.get("content"), f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _text(content: Any, where: str) -> str:
    try:
        return text_of(content, where, TEXT_PARTS)
    except ProtocolError as exc:
        raise ProtocolError(exc.status, exc.message, exc.param or where) from None


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ProtocolError(400, f"{where}: a function_call item needs a string call_id and name", where)
    if not isinstance(arguments, str):
        raise ProtocolError(400, f"{where}.arguments: must be a JSON string", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(tools: Any, where: str = "tools") -> list[dict[str, Any]]:
    """Function tools as chat tools; a `namespace` tool's functions join them; hosted tools
    (web_search, file_search, ...) run at OpenAI, so they are left out: nothing here could run
    them, and a client such as the Codex CLI offers web_search by default."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ProtocolError(400, f"{where}: must be a list of function tools", where)
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace":
            out += _tools(tool.get("tools"), f"{where}[{i}].tools")
            continue
        if kind != "function":
            if isinstance(kind, str):
                continue  # a hosted tool
            raise ProtocolError(400, f"{where}[{i}]: must be an object with a type", f"{where}[{i}]")
        function = {"name": tool.get("name")}  # OpenAI's key order, which the template prints
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object"}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ProtocolError(
        400, "tool_choice: must be auto, none, required or {type: function, name}", "tool_choice"
    )


# --- reply --------------------------------------------------------------------------------


def from_chat(reply: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The Responses body of a chat completion (its first choice)."""
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        summary = [{"type": "summary_text", "text": message["reasoning_content"]}]
        output.append({"type": "reasoning", "id": _id("rs"), "summary": summary})
    if message.get("content") or not message.get("tool_calls"):
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        output.append(
            {
                "type": "message",
                "id": _id("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in message.get("tool_calls") or []:
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    usage = reply.get("usage") or {}
    cut = choice.get("finish_reason") == "length"
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.get("model") or reply.get("model"),
        "output": output,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens", 0)),
            "output_tokens": int(usage.get("completion_tokens", 0)),
            "total_tokens": int(usage.get("total_tokens", 0)),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _as_chat(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the assistant chat message they came from."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            message["reasoning_content"] = item["summary"][0]["text"]
        elif item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        else:
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            message.setdefault("tool_calls", []).append(call)
    return [message]


async def events(response: dict[str, Any]) -> AsyncIterator[bytes]:
    """A whole Responses body re-emitted as its stream events."""
    sequence = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse_event(kind, {"type": kind, "sequence_number": sequence - 1, **data})

    pending = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(response["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            empty = {**part, "text": ""}
            yield event("response.content_part.added", **ids, content_index=0, part=empty)
            yield event("response.output_text.delta", **ids, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, content_index=0, part=part)
        elif item["type"] == "function_call":
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        else:
            yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.output_item.done", output_index=index, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(done, response=response)

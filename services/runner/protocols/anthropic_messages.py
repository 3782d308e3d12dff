"""Anthropic Messages (`POST .../v1/messages`) on the gateway.

Request -> chat completions:
- `system` (a string or text blocks) -> the first message, role system; a `system` turn inside
  `messages` -> a system message there;
- a user turn's `text` blocks -> one user message (texts joined); its `tool_result` blocks ->
  one `tool` message each (before the text, where Anthropic requires them), and each must
  answer a `tool_use` id of an earlier assistant turn;
- an assistant turn's `text` -> content, `tool_use` -> `tool_calls` (input as JSON arguments),
  `thinking` -> reasoning_content;
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` auto / any /
  tool / none -> auto / required / the named function / none;
- `max_tokens` (required, as in Anthropic's API), `stop_sequences`, `temperature`, `top_p`.

Reply: the assistant message's reasoning -> a `thinking` block, content -> a `text` block,
each parsed tool call -> a `tool_use` block; finish reason -> stop_reason (tool_calls ->
tool_use, length -> max_tokens, a stop string -> stop_sequence naming it, else end_turn);
usage -> input_tokens / output_tokens. `stream: true` sends Anthropic's event sequence
(message_start, per block content_block_start / _delta / _stop, message_delta,
message_stop). Errors: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from . import (
    ProtocolError,
    chat_result,
    decode_body,
    error_message,
    json_response,
    matched_stop,
    sse_event,
    text_of,
)

ERROR_TYPES = {  # HTTP status -> Anthropic error type
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
SAMPLING = ("temperature", "top_p")  # passed through as they are
IGNORED = ("metadata", "service_tier", "thinking", "container", "mcp_servers", "context_management")


async def handle(request: Request, call: Any) -> Response:
    """One Messages request: `call` is the gateway's ProtocolCall."""
    if call.state is None:
        return error(404, "this attempt is over (or never existed): its base URL is no longer served")
    try:
        body = decode_body(await request.body())
        chat, stream = to_chat(body)
    except ProtocolError as exc:
        return error(exc.status, exc.message)
    status, reply = chat_result(await call.forward(chat))
    if status != 200:
        message, param, code = error_message(reply)
        if code == "context_length_exceeded":
            message = f"prompt is too long: {message}"
        return error(status, f"{param}: {message}" if param and not message.startswith(param) else message)
    message = from_chat(reply, str(body.get("model") or ""), body.get("stop_sequences") or [])
    if stream:
        return StreamingResponse(events(message), media_type="text/event-stream")
    return json_response(message)


def error(status: int, message: str) -> Response:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, status)


# --- request ------------------------------------------------------------------------------


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The chat-completions body for a Messages request, and whether it streams."""
    max_tokens = _max_tokens(body.get("max_tokens"))
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ProtocolError(400, "messages: must be a non-empty list of {role, content} objects")
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": text_of(body["system"], "system", ("text",))})
    tool_ids: set[str] = set()
    for i, message in enumerate(raw_messages):
        messages += _turn(message, f"messages.{i}", tool_ids)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _sampling(body, chat)
    return chat, bool(body.get("stream"))


def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """stop_sequences, temperature, top_p into `chat`; top_k refused."""
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ProtocolError(400, "stop_sequences: must be a list of non-empty strings")
        if stops:
            chat["stop"] = stops
    for name in SAMPLING:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("top_k") is not None:
        raise ProtocolError(400, "top_k: not supported by squall inference; leave it unset")
    chat["logprobs"] = True  # token texts: which stop sequence ended the reply


def _max_tokens(value: Any) -> int:
    if value is None:
        raise ProtocolError(400, "max_tokens: Field required (the Messages API needs it on every request)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProtocolError(400, f"max_tokens: must be an integer >= 1, got {value!r}")
    return value


def _turn(message: Any, where: str, tool_ids: set[str]) -> list[dict[str, Any]]:
    """One Messages turn -> chat messages (a user turn with tool results gives several)."""
    if not isinstance(message, dict):
        raise ProtocolError(400, f"{where}: must be an object with role and content")
    role, content = message.get("role"), message.get("content")
    if role == "system":  # a system turn inside the conversation (Claude Code sends them)
        return [{"role": "system", "content": text_of(content, f"{where}.content", ("text",))}]
    if role not in ("user", "assistant"):
        raise ProtocolError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {role!r}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ProtocolError(400, f"{where}.content: must be a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, f"{where}.content", tool_ids)]
    out, texts = [], []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(text_of([block], at.rpartition(".")[0], ("text",)))
        elif kind == "tool_result":
            out.append(_tool_result(block, at, tool_ids))
        else:
            raise ProtocolError(
                400,
                f"{at}.type: {kind!r} is not a user content block squall serves; "
                "use 'text' or 'tool_result' (images and documents are not supported)",
            )
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(content: list[Any], where: str, tool_ids: set[str]) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # nothing readable to render
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise ProtocolError(400, f"{at}: a tool_use block needs a string id and name")
            if not isinstance(block.get("input", {}), dict):
                raise ProtocolError(400, f"{at}.input: must be an object")
            tool_ids.add(call_id)
            arguments = json.dumps(block.get("input", {}))
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        else:
            raise ProtocolError(
                400,
                f"{at}.type: {kind!r} is not an assistant content block squall serves; "
                "use 'text', 'thinking' or 'tool_use'",
            )
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    return out


def _tool_result(block: dict[str, Any], where: str, tool_ids: set[str]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if call_id not in tool_ids:
        raise ProtocolError(
            400,
            f"{where}.tool_use_id: {call_id!r} answers no tool_use block of an earlier assistant "
            f"turn (known ids: {', '.join(sorted(tool_ids)) or 'none'})",
        )
    content = block.get("content", "")
    text = text_of(content, f"{where}.content", ("text",)) if content else ""
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ProtocolError(400, "tools: must be a list of {name, description, input_schema} objects")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ProtocolError(
                400,
                f"tools.{i}: only client tools with an input_schema are served "
                f"(got type {kind!r}); server tools run at Anthropic, not here",
            )
        function = {"name": tool.get("name")}  # OpenAI's key order, which the template prints
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ProtocolError(400, f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")


# --- reply --------------------------------------------------------------------------------


def from_chat(reply: dict[str, Any], model: str, stops: list[str]) -> dict[str, Any]:
    """The Messages body of a chat completion (its first choice)."""
    choice = reply["choices"][0]
    message = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(function["arguments"] or "{}"),
            }
        )
    stop = matched_stop(choice, stops)
    reason = "stop_sequence" if stop else STOP_REASONS.get(choice.get("finish_reason"), "end_turn")
    usage = reply.get("usage") or {}
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model or reply.get("model"),
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens", 0)),
            "output_tokens": int(usage.get("completion_tokens", 0)),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


async def events(message: dict[str, Any]) -> AsyncIterator[bytes]:
    """A whole Messages body re-emitted as Anthropic's stream events."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    yield sse_event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            empty, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield sse_event(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": empty}
        )
        yield sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        )
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield sse_event(
        "message_delta",
        {"type": "message_delta", "delta": delta, "usage": {"output_tokens": usage["output_tokens"]}},
    )
    yield sse_event("message_stop", {"type": "message_stop"})

"""Other LLM APIs on the gateway, translated to and from one chat-completions call.

Each module serves one protocol on the attempt's URLs (`/a/{token}[/agent/{name}]/v1/...`):
- `anthropic_messages`: Anthropic Messages, `POST .../v1/messages`;
- `openai_responses`: OpenAI Responses, `POST .../v1/responses`.

A handler validates the request in its protocol's terms, builds the chat-completions body the
served model's chat template renders (system, messages, tool calls and results, tools,
tool_choice, stop, max_tokens), and hands it to the gateway's `forward`, which routes,
records the Turn (the sampled token ids, never re-tokenised) and attributes it like any chat
call. The chat reply is then spelt in the protocol's shape, whole or as its own SSE events;
errors, the gateway's and the server's, come back in the protocol's error shape.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

JSON = "application/json"


class ProtocolError(Exception):
    """A request the protocol layer refuses; `param` is the field at fault (dotted path)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or a ProtocolError saying why not."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def chat_result(response: Response) -> tuple[int, dict[str, Any]]:
    """(status, decoded body) of the gateway's chat answer."""
    return response.status_code, orjson.loads(bytes(response.body))


def error_message(reply: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an OpenAI-shaped error body."""
    error = reply.get("error") if isinstance(reply.get("error"), dict) else {}
    return str(error.get("message") or reply), error.get("param"), error.get("code")


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type=JSON)


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with an `event:` line, as Anthropic and Responses streams send."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def text_of(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a content that is a string or a list of text blocks of the given types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(400, f"{where}: must be a string or a list of content blocks", where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds:
            raise ProtocolError(
                400,
                f"{where}.{j}.type: {kind!r} is not supported here; use one of {', '.join(kinds)}",
                f"{where}.{j}.type",
            )
        if not isinstance(block.get("text"), str):
            raise ProtocolError(400, f"{where}.{j}.text: must be a string", f"{where}.{j}.text")
        parts.append(block["text"])
    return "".join(parts)


def sampled_text(choice: dict[str, Any]) -> str:
    """Everything the model wrote, stop string included: the logprob entries' token texts
    (the gateway always asks for them)."""
    entries = (choice.get("logprobs") or {}).get("content") or []
    return "".join(entry.get("token", "") for entry in entries)


def matched_stop(choice: dict[str, Any], stops: list[str]) -> str | None:
    """Which stop sequence ended a choice that finished on 'stop', or None (end of turn)."""
    if choice.get("finish_reason") != "stop" or not stops:
        return None
    text = sampled_text(choice)
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found)[1] if found else None

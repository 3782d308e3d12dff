"""Response bodies of the OpenAI-compatible API: what the routes send back, and nothing else.

Chat and text completions (whole bodies and SSE chunks), tool calls in a chat message, logprob
entries, usage, the `weight_version`/`node` fields and the `x-squall-weight-version` header.
No function here reads a request or touches the engine; `routes.py` decides, this module
spells the answer.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse

from squall.inference.engines.engine import Delta
from squall.inference.http.protocol import ApiError
from squall.inference.toolparsers import PARSERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
VERSION_HEADER = "x-squall-weight-version"
LOGPROB_FLOOR = -1e4  # a logprob that underflowed to -inf is sent as this (JSON has no infinity)


class Choice:
    """One choice of a non-streaming request, as its deltas arrive."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.text += delta.text
        self.finish_reason = delta.finish_reason or self.finish_reason


class TokenTexts:
    """Text and UTF-8 bytes of single token ids, each decoded once (logprob entries name tokens)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.known: dict[int, tuple[str, list[int]]] = {}  # token id -> (text, its UTF-8 bytes)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        known = self.known.get(token_id)
        if known is None:
            text = self.decode([token_id])
            known = self.known[token_id] = (text, list(text.encode()))
        return known


class ReasoningSplit:
    """Splits one choice's text, piece by piece, into reasoning and content, as vLLM's
    reasoning parsers do: a reply that starts with <think> (after whitespace) is reasoning up
    to </think> (all of it when never closed), the rest content; any other reply is content.
    Text that may still turn into a tag is held back until it cannot, so streamed pieces add up
    to exactly the whole reply's split. Only the text is split: token ids are never touched."""

    def __init__(self) -> None:
        self.held = ""
        self.state = "start"  # start | reasoning | content
        self.found = False  # the reply opened with <think>

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) released by this piece; `final` releases everything held."""
        self.held += piece
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.found, self.held = "reasoning", True, head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head) and not final:
                return "", ""  # whitespace or a partial "<thi": wait for more
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.held.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else _partial_tag(self.held, THINK_CLOSE)
                reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return reasoning, ""
            reasoning, self.held = self.held[:end], self.held[end + len(THINK_CLOSE) :]
            self.state = "content"
            content, self.held = self.held, ""
            return reasoning, content
        content, self.held = self.held, ""
        return "", content


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_reasoning(text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning or None when it has none, content)."""
    split = ReasoningSplit()
    reasoning, content = split.feed(text, final=True)
    return (reasoning if split.found else None), content


@dataclass(frozen=True)
class Reply:
    """What every body and chunk of one response shares."""

    meta: dict[str, Any]  # id, created, model
    node: str  # this node's id, in every body
    prompt_ids: list[int]  # the prompt as tokenized (sent with return_token_ids)
    token_texts: TokenTexts
    logprobs: bool  # the request asked for logprobs
    return_token_ids: bool  # the request asked for token ids
    prefix: str = ""  # chat: the tool_choice prefill, part of the prompt, shown in the content
    tool_choice: str | None = None  # chat: None = no tools offered, so no tool-call parsing
    reasoning: bool = False  # chat: split <think>...</think> into reasoning_content
    parser: Any = PARSERS["hermes"]  # chat: the model family's tool-call format (toolparsers.py)
    on_parse_failure: Callable[[], None] = lambda: None  # chat: tool-call-like text that did not parse

    def parse_tools(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished reply; a failed attempt is counted, stays content."""
        parsed = self.parser.parse(text)
        if parsed.failed:
            self.on_parse_failure()
        return parsed.content, parsed.calls

    def logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        entries = []
        for token_id, logprob in zip(ids, logprobs, strict=True):
            text, raw = self.token_texts(token_id)
            value = logprob if math.isfinite(logprob) else LOGPROB_FLOOR
            entries.append({"token": text, "logprob": value, "bytes": raw, "top_logprobs": []})
        return entries

    def chunk(self, obj: str, choices: list[dict[str, Any]], version: int, **extra: Any) -> bytes:
        """One SSE event of a stream."""
        body = {
            **self.meta,
            "object": obj,
            "choices": choices,
            **extra,
            "weight_version": version,
            "node": self.node,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), error.status)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completed(
    reply: Reply, obj: str, choices: list[dict[str, Any]], version: int, completion_tokens: int
) -> Response:
    """A whole (non-streaming) body: choices, usage, weight version and node, version header."""
    body = {**reply.meta, "object": obj, "choices": choices}
    body.update(
        usage=usage(len(reply.prompt_ids), completion_tokens), weight_version=version, node=reply.node
    )
    return json_response(body, headers={VERSION_HEADER: str(version)})


# --- chat completions ---------------------------------------------------------------------


def chat_message(reply: Reply, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice and its finish_reason (reasoning split off,
    then tool calls parsed from the content)."""
    reasoning, text = split_reasoning(text) if reply.reasoning else (None, text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reply.tool_choice is not None:
        content, calls = reply.parse_tools(reply.prefix + text)
        if calls:
            message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        elif reply.prefix:
            message["content"] = reply.prefix + text
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message, finish


def chat_choice(reply: Reply, index: int, c: Choice) -> dict[str, Any]:
    message, finish = chat_message(reply, c.text, c.finish_reason)
    item: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if reply.logprobs:
        item["logprobs"] = {"content": reply.logprob_entries(c.token_ids, c.logprobs)}
    if reply.return_token_ids:
        item["prompt_token_ids"], item["token_ids"] = reply.prompt_ids, c.token_ids
    return item


def chat_completion(reply: Reply, choices: dict[int, Choice], version: int) -> Response:
    out = [chat_choice(reply, index, c) for index, c in sorted(choices.items())]
    return completed(reply, "chat.completion", out, version, completion_tokens(choices))


class _ChatStream:
    """Per-choice state of a streamed chat completion."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.buffered: dict[int, str] = {}  # index -> text held back to parse tool calls at the end
        self.started: set[int] = set()
        self.splits: dict[int, ReasoningSplit] = {}  # index -> its reasoning split (reply.reasoning)

    def delta(self, d: Delta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if d.index not in self.started:
            delta["role"] = "assistant"
        if self.reply.reasoning:
            return self._split_delta(d, delta)
        return self._content_delta(d, d.text, delta)

    def _split_delta(self, d: Delta, delta: dict[str, Any]) -> dict[str, Any]:
        split = self.splits.setdefault(d.index, ReasoningSplit())
        reasoning, content = split.feed(d.text, final=bool(d.finish_reason))
        if reasoning:
            delta["reasoning_content"] = reasoning
        return self._content_delta(d, content, delta, quiet=bool(reasoning) or split.state != "content")

    def _content_delta(
        self, d: Delta, text: str, delta: dict[str, Any], quiet: bool = False
    ) -> dict[str, Any]:
        """`text` is the content part of this delta; `quiet`: no empty content when there is none."""
        if self.reply.tool_choice is not None:
            text = self.buffered[d.index] = self.buffered.get(d.index, self.reply.prefix) + text
            if d.finish_reason:
                content, calls = self.reply.parse_tools(text)
                if calls:
                    delta["content"] = content
                    delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(calls)]
                else:
                    delta["content"] = text
        elif text or (d.index not in self.started and not quiet):
            delta["content"] = text
        return delta

    def item(self, d: Delta) -> dict[str, Any]:
        reply, delta = self.reply, self.delta(d)
        item: dict[str, Any] = {"index": d.index, "delta": delta, "finish_reason": None, "logprobs": None}
        if d.finish_reason:
            item["finish_reason"] = "tool_calls" if delta.get("tool_calls") else d.finish_reason
        if reply.logprobs:
            item["logprobs"] = {"content": reply.logprob_entries(d.token_ids, d.logprobs)}
        if reply.return_token_ids:
            item["token_ids"] = d.token_ids
            if d.index not in self.started:
                item["prompt_token_ids"] = reply.prompt_ids
        self.started.add(d.index)
        return item


async def chat_chunks(
    reply: Reply,
    first: Delta,
    stream: AsyncIterator[Delta],
    *,
    include_usage: bool,
    on_done: Callable[[int], None],
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed chat completion; `on_done(completion tokens)` at its end."""
    version, state, completion_tokens = first.weight_version, _ChatStream(reply), 0
    async for d in prepend(first, stream):
        completion_tokens += len(d.token_ids)
        yield reply.chunk("chat.completion.chunk", [state.item(d)], version)
    on_done(completion_tokens)
    if include_usage:
        tokens = usage(len(reply.prompt_ids), completion_tokens)
        yield reply.chunk("chat.completion.chunk", [], version, usage=tokens)


# --- text completions ---------------------------------------------------------------------


def text_choice(
    reply: Reply,
    index: int,
    ids: list[int],
    logprobs: list[float],
    text: str,
    finish: str | None,
    first: bool,
) -> dict[str, Any]:
    """One choice of a text completion (`first`: its first chunk, which carries the prompt ids)."""
    item: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if reply.logprobs:
        entries = reply.logprob_entries(ids, logprobs)
        item["logprobs"] = {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": None,
            "text_offset": [],
            "content": entries,
        }
    if reply.return_token_ids:
        item["token_ids"] = ids
        if first:
            item["prompt_token_ids"] = reply.prompt_ids
    return item


def text_completion(reply: Reply, choices: dict[int, Choice], version: int) -> Response:
    out = [
        text_choice(reply, i, c.token_ids, c.logprobs, c.text, c.finish_reason, True)
        for i, c in sorted(choices.items())
    ]
    return completed(reply, "text_completion", out, version, completion_tokens(choices))


async def text_chunks(
    reply: Reply, first: Delta, stream: AsyncIterator[Delta], *, on_done: Callable[[int], None]
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed text completion; `on_done(completion tokens)` at its end."""
    started: set[int] = set()
    total = 0
    async for d in prepend(first, stream):
        total += len(d.token_ids)
        item = text_choice(
            reply, d.index, d.token_ids, d.logprobs, d.text, d.finish_reason, d.index not in started
        )
        started.add(d.index)
        yield reply.chunk("text_completion", [item], first.weight_version)
    on_done(total)


# --- streaming ----------------------------------------------------------------------------


async def prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The stream again with its first delta, which was read early to learn the weight version."""
    yield first
    async for delta in rest:
        yield delta


def event_stream(version: int, chunks: AsyncIterator[bytes], stream: AsyncIterator[Delta]) -> Response:
    """Server-sent events: `chunks`, an in-band error if generation fails midway, then [DONE].

    `version` (of the first delta, already read) goes in the header; `stream` is closed at the
    end whatever happens, so the engine drops the request's sequences.
    """

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the status line is gone: report in-band, as OpenAI does
            yield b"data: " + orjson.dumps(ApiError(500, f"generation failed: {exc}").body()) + b"\n\n"
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={VERSION_HEADER: str(version), "cache-control": "no-cache"},
    )


def completion_tokens(choices: dict[int, Choice]) -> int:
    return sum(len(c.token_ids) for c in choices.values())

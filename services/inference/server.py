"""The OpenAI-compatible HTTP API over one engine (FastAPI).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics. With an API key configured, /v1/* needs `Authorization: Bearer KEY`
(/health and /metrics stay open for probes and scrapers).

Beyond OpenAI (see docs/inference.md): extra body fields `return_token_ids` (each choice gets
`prompt_token_ids` and `token_ids`) and `ignore_eos`; every response has top-level
`weight_version` and `node` and the header `x-squall-weight-version`. Logprobs are the
model's own at temperature 1 (raw logits, before temperature and top_p).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .detokenize import decoder_of
from .engine import Delta, Engine, SamplingParams
from .metrics import InferenceMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, parse
from .tools import (
    ToolError,
    forced_prefix,
    normalize_messages,
    parse_tool_calls,
    resolve_tool_choice,
    validate_tools,
)

VERSION_HEADER = "x-squall-weight-version"
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there
LOGPROB_FLOOR = -1e4  # a logprob that underflowed to -inf is sent as this (JSON has no infinity)


class _Choice:
    """One choice as its deltas arrive."""

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


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def create_app(
    engine: Engine, *, model_name: str, node: str, api_key: str = "", metrics: InferenceMetrics
) -> FastAPI:
    """The API of one node: `engine` samples, the app speaks OpenAI."""
    app = FastAPI(title="squall inference", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer
    served_names = {model_name}
    metrics.watch_engine(engine.stats)

    decode = decoder_of(tokenizer)
    token_texts: dict[int, tuple[str, list[int]]] = {}  # token id -> (text, its UTF-8 bytes)

    def token_text(token_id: int) -> tuple[str, list[int]]:
        known = token_texts.get(token_id)
        if known is None:
            text = decode([token_id])
            known = token_texts[token_id] = (text, list(text.encode()))
        return known

    def logprob_entries(ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        entries = []
        for token_id, logprob in zip(ids, logprobs, strict=True):
            text, raw = token_text(token_id)
            value = logprob if math.isfinite(logprob) else LOGPROB_FLOOR
            entries.append({"token": text, "logprob": value, "bytes": raw, "top_logprobs": []})
        return entries

    def check_model(name: str) -> None:
        if name not in served_names:
            raise ApiError(
                404,
                f"model {name!r} is not served here; this node serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    def sampling(req: Any, prompt_len: int, max_tokens: int | None) -> SamplingParams:
        if (field := req.unsupported()) is not None:
            raise ApiError(
                400, f"{field} is not supported by squall inference; leave it unset or 0", param=field
            )
        limit = engine.max_model_len
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"the prompt is {prompt_len} tokens, but this model's context is {limit} tokens; shorten the prompt",
                param="messages",
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise ApiError(
                400,
                f"this model's context is {limit} tokens, but {prompt_len + max_tokens} were requested "
                f"({prompt_len} in the prompt, max_tokens {max_tokens}); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if req.n > engine.max_batch:
            raise ApiError(
                400, f"n is {req.n}, more than this node's max_batch ({engine.max_batch})", param="n"
            )
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limit - prompt_len,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            n=req.n,
            stop=req.stop_strings(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return _json(exc.body(), exc.status)

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> Response:
        # The engine already logged a failed forward; the client gets a JSON 500 it can retry.
        return _json(ApiError(500, f"generation failed: {exc}").body(), 500)

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok", "weight_version": engine.weight_version, "node": node})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.weight_version.set(engine.weight_version)
        metrics.served_version.set(engine.weight_version)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "squall",
            "max_model_len": engine.max_model_len,
        }
        return _json({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatRequest = parse(ChatRequest, await body_of(request))
        check_model(req.model)
        try:
            tools = validate_tools(req.tools) if req.tools is not None else None
            choice = resolve_tool_choice(req.tool_choice, tools)
        except ToolError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        messages = normalize_messages(req.messages)
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        try:
            prompt = tokenizer.apply_chat_template(
                messages, tools=tools if choice else None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template error is the caller's message shape
            raise ApiError(
                400, f"messages cannot be rendered by the model's chat template: {exc}", param="messages"
            ) from None
        prefix = forced_prefix(choice)
        prompt_ids = tokenizer.encode(prompt + prefix, add_special_tokens=False)
        params = sampling(req, len(prompt_ids), req.max_completion_tokens or req.max_tokens)
        metrics.prompt_tokens.inc(len(prompt_ids))
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        stream = engine.generate(prompt_ids, params, stream=req.stream)
        if req.stream:
            return await _sse(
                stream, lambda first: _chat_chunks(req, meta, prompt_ids, prefix, choice, first, stream)
            )

        choices, version = await _collect(stream, params.n, request)
        out = []
        for index, c in sorted(choices.items()):
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if choice is not None:
                content, calls = parse_tool_calls(prefix + c.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = "tool_calls"
                elif prefix:
                    message["content"] = prefix + c.text
            item: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
            }
            if req.logprobs:
                item["logprobs"] = {"content": logprob_entries(c.token_ids, c.logprobs)}
            if req.return_token_ids:
                item["prompt_token_ids"], item["token_ids"] = prompt_ids, c.token_ids
            out.append(item)
        body = {**meta, "object": "chat.completion", "choices": out}
        return _finish(body, version, len(prompt_ids), choices)

    def _chat_chunks(
        req: ChatRequest,
        meta: dict,
        prompt_ids: list[int],
        prefix: str,
        choice: str | None,
        first: Delta,
        stream: AsyncIterator[Delta],
    ) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            version = first.weight_version
            buffered = {}  # index -> text held back to parse tool calls at the end
            started: set[int] = set()
            completion_tokens = 0

            async for d in _prepend(first, stream):
                completion_tokens += len(d.token_ids)
                delta: dict[str, Any] = {}
                if d.index not in started:
                    delta["role"] = "assistant"
                item: dict[str, Any] = {
                    "index": d.index,
                    "delta": delta,
                    "finish_reason": None,
                    "logprobs": None,
                }
                if choice is not None:
                    buffered[d.index] = buffered.get(d.index, prefix) + d.text
                    if d.finish_reason:
                        content, calls = parse_tool_calls(buffered[d.index])
                        if calls:
                            delta["content"] = content
                            delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(calls)]
                        else:
                            delta["content"] = buffered[d.index]
                elif d.text or d.index not in started:
                    delta["content"] = d.text
                if d.finish_reason:
                    item["finish_reason"] = "tool_calls" if delta.get("tool_calls") else d.finish_reason
                if req.logprobs:
                    item["logprobs"] = {"content": logprob_entries(d.token_ids, d.logprobs)}
                if req.return_token_ids:
                    item["token_ids"] = d.token_ids
                    if d.index not in started:
                        item["prompt_token_ids"] = prompt_ids
                started.add(d.index)
                chunk = {
                    **meta,
                    "object": "chat.completion.chunk",
                    "choices": [item],
                    "weight_version": version,
                    "node": node,
                }
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            metrics.generated_tokens.inc(completion_tokens)
            if (req.stream_options or {}).get("include_usage"):
                usage = _usage(len(prompt_ids), completion_tokens)
                chunk = {
                    **meta,
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": usage,
                    "weight_version": version,
                    "node": node,
                }
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"

        return chunks()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await body_of(request))
        check_model(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            vocab = len(tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(
                    400, f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            prompt_ids = list(prompt)
        params = sampling(req, len(prompt_ids), 16 if req.max_tokens is None else req.max_tokens)
        metrics.prompt_tokens.inc(len(prompt_ids))
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        stream = engine.generate(prompt_ids, params, stream=req.stream)
        want_logprobs = req.logprobs is not None

        def choice_body(
            index: int, ids: list[int], logprobs: list[float], text: str, finish: str | None, first: bool
        ) -> dict[str, Any]:
            item: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
            if want_logprobs:
                entries = logprob_entries(ids, logprobs)
                item["logprobs"] = {
                    "tokens": [e["token"] for e in entries],
                    "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": None,
                    "text_offset": [],
                    "content": entries,
                }
            if req.return_token_ids:
                item["token_ids"] = ids
                if first:
                    item["prompt_token_ids"] = prompt_ids
            return item

        if req.stream:

            def chunks(first: Delta) -> AsyncIterator[bytes]:
                async def gen() -> AsyncIterator[bytes]:
                    started: set[int] = set()
                    total = 0

                    async for d in _prepend(first, stream):
                        total += len(d.token_ids)
                        item = choice_body(
                            d.index, d.token_ids, d.logprobs, d.text, d.finish_reason, d.index not in started
                        )
                        started.add(d.index)
                        chunk = {
                            **meta,
                            "object": "text_completion",
                            "choices": [item],
                            "weight_version": first.weight_version,
                            "node": node,
                        }
                        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    metrics.generated_tokens.inc(total)

                return gen()

            return await _sse(stream, chunks)

        choices, version = await _collect(stream, params.n, request)
        out = [
            choice_body(i, c.token_ids, c.logprobs, c.text, c.finish_reason, True)
            for i, c in sorted(choices.items())
        ]
        return _finish(
            {**meta, "object": "text_completion", "choices": out}, version, len(prompt_ids), choices
        )

    def _finish(body: dict[str, Any], version: int, prompt_len: int, choices: dict[int, _Choice]) -> Response:
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        metrics.generated_tokens.inc(completion_tokens)
        body.update(usage=_usage(prompt_len, completion_tokens), weight_version=version, node=node)
        return _json(body, headers={VERSION_HEADER: str(version)})

    return app


class _Gate:
    """Pure ASGI middleware: the API key check and per-request metrics on /v1/*.

    (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers, and
    the latency here runs to the last byte of a stream, not to its first.)
    """

    def __init__(self, app: Any, *, api_key: str, metrics: InferenceMetrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {api_key}".encode() if api_key else b"", metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.expected and not hmac.compare_digest(
                dict(scope["headers"]).get(b"authorization", b""), self.expected
            ):  # constant time: the reply's timing says nothing about how much of the key matched
                error = ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY")
                await _json(error.body(), 401)(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.latency.labels(path).observe(time.monotonic() - start)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The stream again with its first delta, which was read early to learn the weight version."""
    yield first
    async for delta in rest:
        yield delta


async def _collect(stream: AsyncIterator[Delta], n: int, request: Request) -> tuple[dict[int, _Choice], int]:
    """All deltas of a non-streaming request; its sequences are cancelled if the client leaves."""
    choices = {i: _Choice() for i in range(n)}
    version = 0

    async def gather() -> None:
        nonlocal version
        async for delta in stream:
            choices[delta.index].add(delta)
            version = delta.weight_version

    task = asyncio.create_task(gather())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # the engine drops the request's sequences at its next step
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await stream.aclose()
            raise ApiError(499, "the client closed the connection; generation was cancelled")
    task.result()
    return choices, version


async def _sse(stream: AsyncIterator[Delta], make_chunks: Any) -> Response:
    """Server-sent events; the first delta is awaited first so its version goes in the header."""
    first = await anext(stream)
    chunks = make_chunks(first)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the status line is gone: report in-band, as OpenAI does
            yield b"data: " + orjson.dumps(ApiError(500, f"generation failed: {exc}").body()) + b"\n\n"
        finally:
            await stream.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={VERSION_HEADER: str(first.weight_version), "cache-control": "no-cache"},
    )

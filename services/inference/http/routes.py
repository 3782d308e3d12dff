"""The routes of the OpenAI-compatible API as plain handlers: `handler(request, state)`.

Each handler validates the request (protocol.py, tools.py), builds the prompt and the
sampling settings, asks the engine, counts tokens, and hands the deltas to render.py for the
body. `server.create_app` binds them to their paths; `ROUTES` lists them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from squall.inference.engines.engine import Delta, SamplingParams
from squall.inference.http.protocol import ApiError, ChatRequest, CompletionRequest, parse
from squall.inference.http.state import ServerState, model_error
from squall.inference.prompt import NoChatTemplate
from squall.inference.toolcalls import (
    ToolError,
    normalize_messages,
    resolve_tool_choice,
    validate_tools,
)
from squall.inference.weights.catalog import ModelUnavailable

from . import render

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there

Handler = Callable[[Request, ServerState], Awaitable[Response]]


async def health(_: Request, state: ServerState) -> Response:
    return render.json_response(
        {"status": "ok", "weight_version": state.engine.weight_version, "node": state.node}
    )


async def prometheus(_: Request, state: ServerState) -> Response:
    state.metrics.weight_version.set(state.engine.weight_version)
    state.metrics.served_version.set(state.engine.weight_version)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(_: Request, state: ServerState) -> Response:
    """The served name (the `policy` role), then each other trained role, with the version a
    request for it gets now."""
    served = state.engine.served_versions()
    names = [(state.model_name, served.get("policy", 0))]
    names += [(role, v) for role, v in sorted(served.items()) if role != "policy"]
    cards = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "squall",
            "max_model_len": state.engine.max_model_len,
            "weight_version": version,
        }
        for name, version in names
    ]
    return render.json_response({"object": "list", "data": cards})


async def chat_completions(request: Request, state: ServerState) -> Response:
    req: ChatRequest = parse(ChatRequest, await body_of(request))
    role, version = await state.resolve_model(req.model)
    prompt_ids, prefix, choice = chat_prompt(state, req)
    params = sampling(state, req, len(prompt_ids), req.max_completion_tokens or req.max_tokens)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    reply = render.Reply(
        meta={"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model},
        node=state.node,
        prompt_ids=prompt_ids,
        token_texts=state.token_texts,
        logprobs=bool(req.logprobs),
        return_token_ids=req.return_token_ids,
        prefix=prefix,
        tool_choice=choice,
        reasoning=state.reasoning,
        parser=state.chat_format.parser,
        on_parse_failure=state.metrics.tool_parse_failures.inc,
    )
    stream = state.engine.generate(prompt_ids, params, stream=req.stream, role=role, version=version)
    if req.stream:
        first = await anext(stream)
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunks = render.chat_chunks(
            reply, first, stream, include_usage=include_usage, on_done=state.metrics.generated_tokens.inc
        )
        return render.event_stream(first.weight_version, chunks, stream)
    choices, version = await collect(stream, params.n, request)
    state.metrics.generated_tokens.inc(render.completion_tokens(choices))
    return render.chat_completion(reply, choices, version)


async def completions(request: Request, state: ServerState) -> Response:
    req: CompletionRequest = parse(CompletionRequest, await body_of(request))
    role, version = await state.resolve_model(req.model)
    prompt_ids = completion_prompt(state, req)
    params = sampling(state, req, len(prompt_ids), 16 if req.max_tokens is None else req.max_tokens)
    state.metrics.prompt_tokens.inc(len(prompt_ids))
    scored = await prompt_scores(state, req, prompt_ids)
    reply = render.Reply(
        meta={"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model},
        node=state.node,
        prompt_ids=prompt_ids,
        token_texts=state.token_texts,
        logprobs=req.logprobs is not None,
        return_token_ids=req.return_token_ids,
    )
    stream = state.engine.generate(prompt_ids, params, stream=req.stream, role=role, version=version)
    if req.stream:
        first = await anext(stream)
        chunks = render.text_chunks(reply, first, stream, on_done=state.metrics.generated_tokens.inc)
        return render.event_stream(first.weight_version, chunks, stream)
    choices, version = await collect(stream, params.n, request)
    state.metrics.generated_tokens.inc(render.completion_tokens(choices))
    response = render.text_completion(reply, choices, version)
    if scored is None:
        return response
    body = orjson.loads(response.body)
    for choice in body["choices"]:
        choice["prompt_logprobs"] = scored
    return render.json_response(body)


async def prompt_scores(
    state: ServerState, req: CompletionRequest, prompt_ids: list[int]
) -> list[Any] | None:
    """`prompt_logprobs` as vLLM writes it, or None when not asked for."""
    if req.prompt_logprobs is None:
        return None
    if req.stream:
        raise ApiError(400, "prompt_logprobs needs stream = false", param="prompt_logprobs")
    try:
        logprobs = await state.engine.prompt_logprobs(prompt_ids)
    except NotImplementedError as exc:
        raise ApiError(400, str(exc), param="prompt_logprobs") from None
    return [
        None
        if lp is None
        else {str(t): {"logprob": lp, "rank": None, "decoded_token": state.token_texts(t)[0]}}
        for t, lp in zip(prompt_ids, logprobs, strict=True)
    ]


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus),
    ("GET", "/v1/models", models),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
]


async def api_error(_: Request, exc: ApiError) -> Response:
    return render.error_response(exc)


async def model_unavailable(_: Request, exc: ModelUnavailable) -> Response:
    # the engine found at admission that the version is gone (e.g. its slot was reused): retryable
    return render.error_response(model_error(exc))


async def server_error(_: Request, exc: Exception) -> Response:
    # The engine already logged a failed forward; the client gets a JSON 500 it can retry.
    return render.error_response(ApiError(500, f"generation failed: {exc}"))


# --- request to prompt and sampling settings ----------------------------------------------


async def body_of(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


def chat_prompt(state: ServerState, req: ChatRequest) -> tuple[list[int], str, str | None]:
    """The prompt's token ids, the tool_choice prefill in them, and the resolved tool_choice."""
    try:
        tools = validate_tools(req.tools) if req.tools is not None else None
        choice = resolve_tool_choice(req.tool_choice, tools)
    except ToolError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    messages = normalize_messages(req.messages)
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    chat = state.chat_format
    try:
        prompt = chat.render(messages, tools if choice else None)
    except NoChatTemplate as exc:
        raise ApiError(400, str(exc), param="messages") from None
    except Exception as exc:  # a template error is the caller's message shape
        raise ApiError(
            400, f"messages cannot be rendered by the model's chat template: {exc}", param="messages"
        ) from None
    prefix = chat.parser.forced_prefix(choice)
    return state.tokenizer.encode(prompt + prefix, add_special_tokens=False), prefix, choice


def completion_prompt(state: ServerState, req: CompletionRequest) -> list[int]:
    prompt = req.single_prompt()
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt, add_special_tokens=True)
    vocab = len(state.tokenizer)
    if any(not 0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", param="prompt")
    return list(prompt)


def sampling(state: ServerState, req: Any, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    """The engine's settings for `req`, or an ApiError naming the field that cannot be served."""
    if (field := req.unsupported()) is not None:
        raise ApiError(400, f"{field} is not supported by squall inference; leave it unset or 0", param=field)
    limit = state.engine.max_model_len
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
    if req.n > state.engine.max_batch:
        raise ApiError(
            400, f"n is {req.n}, more than this node's max_batch ({state.engine.max_batch})", param="n"
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


# --- generation ---------------------------------------------------------------------------


async def collect(
    stream: AsyncIterator[Delta], n: int, request: Request
) -> tuple[dict[int, render.Choice], int]:
    """All deltas of a non-streaming request; its sequences are cancelled if the client leaves."""
    choices = {i: render.Choice() for i in range(n)}
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
            await stream.aclose()  # type: ignore[attr-defined]
            raise ApiError(499, "the client closed the connection; generation was cancelled")
    task.result()
    return choices, version

"""The OpenAI-compatible HTTP API over one engine (FastAPI): wiring only.

Routes (routes.py): POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health, GET /metrics. With an API key configured, /v1/* needs `Authorization: Bearer KEY`
(gate.py; /health and /metrics stay open for probes and scrapers). Bodies are rendered by
render.py; the routes share one `ServerState` (state.py).

Beyond OpenAI (see docs/inference.md): extra body fields `return_token_ids` (each choice gets
`prompt_token_ids` and `token_ids`) and `ignore_eos`; every response has top-level
`weight_version` and `node` and the header `x-squall-weight-version`; with
`inference.reasoning_parser = "think"` a chat reply that opens with <think> carries the text up
to </think> as `reasoning_content` (render.ReasoningSplit), its token ids unchanged. Logprobs are the
model's own at temperature 1 (raw logits, before temperature and top_p).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from squall.inference.engines.engine import Engine
from squall.inference.http.gate import Gate
from squall.inference.http.protocol import ApiError
from squall.inference.http.render import VERSION_HEADER
from squall.inference.http.state import ServerState
from squall.inference.node_metrics import InferenceMetrics
from squall.inference.weights.catalog import ModelUnavailable

from . import routes

__all__ = ["VERSION_HEADER", "create_app"]


def create_app(
    engine: Engine,
    *,
    model_name: str,
    node: str,
    api_key: str = "",
    metrics: InferenceMetrics,
    reasoning_parser: str = "think",
    tool_parser: str = "auto",
    chat_template: str = "",
) -> FastAPI:
    """The API of one node: `engine` samples, the app speaks OpenAI."""
    app = FastAPI(title="squall inference", docs_url=None, redoc_url=None)
    reasoning = reasoning_parser == "think"
    state = ServerState(
        engine=engine,
        model_name=model_name,
        node=node,
        metrics=metrics,
        reasoning=reasoning,
        tool_parser=tool_parser,
        chat_template=chat_template,
    )
    metrics.watch_engine(engine.stats)
    app.add_middleware(Gate, api_key=api_key, metrics=metrics)
    app.add_exception_handler(ApiError, routes.api_error)  # type: ignore[arg-type]
    app.add_exception_handler(ModelUnavailable, routes.model_unavailable)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, routes.server_error)
    for method, path, handler in routes.ROUTES:
        app.add_api_route(path, _bound(handler, state), methods=[method])
    return app


def _bound(handler: routes.Handler, state: ServerState) -> Callable[[Request], Awaitable[Response]]:
    """`handler` as a FastAPI endpoint that receives only the request."""

    async def endpoint(request: Request) -> Response:
        return await handler(request, state)

    endpoint.__name__ = handler.__name__
    return endpoint

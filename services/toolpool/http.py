"""The pool's tools over HTTP, for agents that run as external commands (or anywhere without
Redis access): `squall worker --http-port P` serves

    GET  /health                      200 {"ok": true}
    GET  /v1/tools                    200 {"tools": ["code", "retrieval", "sql", "judge"]}
    POST /v1/tools/{tool}             body {"args": {...}, "deadline_s": 10}
         200 {"result": ...}  |  404 unknown tool  |  400 bad body  |  422 {"error": "<tool error>"}

Each call is the same enqueue-and-wait as client.Tools (one thread per call in flight).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from squall.shared.errors import ToolError
from squall.toolpool.client import Tools
from squall.toolpool.queues import TOOLS

MAX_DEADLINE_S = 600.0


def create_app(tools: Tools) -> FastAPI:
    app = FastAPI(title="squall tools", docs_url=None, redoc_url=None)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/tools")
    def list_tools() -> dict[str, list[str]]:
        return {"tools": list(TOOLS)}

    @app.post("/v1/tools/{tool}")
    async def call(tool: str, request: Request) -> Any:
        if tool not in TOOLS:
            return error(404, f"unknown tool {tool!r}: the pool's tools are {list(TOOLS)}")
        try:
            body = await request.json()
        except ValueError:
            return error(400, 'the body must be JSON: {"args": {...}, "deadline_s": seconds}')
        if not isinstance(body, dict) or not isinstance(body.get("args", {}), dict):
            return error(
                400, f'the body must be {{"args": {{...}}, "deadline_s": seconds}}, got {str(body)[:200]}'
            )
        deadline = body.get("deadline_s")
        if deadline is not None and (
            not isinstance(deadline, int | float) or not 0 < deadline <= MAX_DEADLINE_S
        ):
            return error(400, f"deadline_s must be a number in (0, {MAX_DEADLINE_S:g}], got {deadline!r}")
        from starlette.concurrency import run_in_threadpool

        try:
            result = await run_in_threadpool(tools.call, tool, body.get("args", {}), deadline)
        except ToolError as exc:
            return error(422, str(exc))
        return {"result": result}

    return app


def serve(tools: Tools, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(create_app(tools), host=host, port=port, log_level="warning")

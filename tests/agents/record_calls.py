"""Run an agent command with its LLM traffic recorded: a transparent pass-through on loopback.

    python tests/agents/record_calls.py OUT.json -- COMMAND [ARGS...]

Used as a runner's `--agent-cmd`. It starts a small HTTP proxy in front of the attempt's
gateway URL (`OPENAI_BASE_URL`), points the command's `OPENAI_BASE_URL` at the proxy (same
path, so per-agent URLs derived from it work too), hands the task on stdin through, and
writes every exchange — method, path, request JSON, status, response body as the agent got it
(SSE text for streams) — to OUT.json when the command exits. The command's stdout (the reward)
and exit status pass through unchanged. The agent code itself knows nothing of this; the
tests compare these exchanges with the token ids the gateway recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from urllib.parse import urlsplit

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

UPSTREAM_TIMEOUT_S = 120.0


def build_app(upstream: str, exchanges: list[dict]) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=UPSTREAM_TIMEOUT_S)

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        upstream_request = client.build_request(
            request.method, request.url.path, content=body, headers=headers, params=request.query_params
        )
        response = await client.send(upstream_request, stream=True)
        record = {
            "method": request.method,
            "path": request.url.path,
            "request": json.loads(body) if body else None,
            "status": response.status_code,
        }

        async def relay():
            parts = []
            try:
                async for chunk in response.aiter_raw():
                    parts.append(chunk)
                    yield chunk
            finally:
                await response.aclose()
                record["response"] = b"".join(parts).decode()
                exchanges.append(record)

        kept = {k: v for k, v in response.headers.items() if k.lower() == "content-type"}
        return StreamingResponse(relay(), status_code=response.status_code, headers=kept)

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


async def main(out_path: str, command: list[str]) -> int:
    gateway = urlsplit(os.environ["OPENAI_BASE_URL"])
    exchanges: list[dict] = []
    app = build_app(f"{gateway.scheme}://{gateway.netloc}", exchanges)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}{gateway.path}"}
    if "ANTHROPIC_BASE_URL" in env:  # the same attempt for Anthropic clients, through the proxy too
        env["ANTHROPIC_BASE_URL"] = f"http://127.0.0.1:{port}{gateway.path.removesuffix('/v1')}"
    task = sys.stdin.buffer.read()
    child = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE, env=env)
    await child.communicate(task)
    server.should_exit = True
    await asyncio.wait_for(serving, 10)
    with open(out_path, "w") as handle:
        json.dump({"exchanges": exchanges}, handle)
    return child.returncode or 0


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: record_calls.py OUT.json -- COMMAND [ARGS...]")
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[3:])))

"""The middleware in front of /v1/*: the API key check and per-request metrics."""

from __future__ import annotations

import hmac
import time
from typing import Any

from squall.inference.http.protocol import ApiError
from squall.inference.http.render import error_response
from squall.inference.node_metrics import InferenceMetrics


class Gate:
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
                await error_response(error)(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.latency.labels(path).observe(time.monotonic() - start)

"""A tiny HTTP endpoint for services without a web framework: liveness, readiness, metrics.

    server, port = start_health_server("0.0.0.0", 9101, ready=lambda: consumer_ok)
    ...
    server.close()   # in the service's `finally`

- `GET /health`  200 {"status": "ok", ...info()}: the process is alive (its threads answer).
- `GET /ready`   200 {"ready": true} when `ready()` returns true, else 503 {"ready": false}; a
  `ready` that raises counts as not ready (and says why). Use it for load balancers and
  systemd/compose health checks: a draining runner reports not ready.
- `GET /metrics` the Prometheus text format of `registry` (default: the process-wide one).
  With `api_key`, /metrics wants `Authorization: Bearer KEY`; /health and /ready stay open
  for probes and reveal nothing but liveness.

Standard library only (http.server, one daemon thread per request), plus prometheus_client.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest


class HealthServer(ThreadingHTTPServer):
    daemon_threads = True  # a hung probe never blocks shutdown
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        ready: Callable[[], bool] | None,
        registry: CollectorRegistry,
        api_key: str,
        info: Callable[[], dict[str, Any]] | None,
    ) -> None:
        super().__init__(address, _Handler)
        self.ready, self.registry, self.api_key, self.info = ready, registry, api_key, info
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        """Stop serving and release the port; safe to call twice."""
        if self.thread is not None:
            self.shutdown()
            self.thread.join(timeout=5)
            self.thread = None
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: HealthServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/health":
            body = {"status": "ok"}
            if self.server.info is not None:
                try:
                    body.update(self.server.info())
                except Exception as exc:  # liveness must not depend on the info callable
                    body["info_error"] = type(exc).__name__
            self._json(200, body)
        elif path == "/ready":
            self._ready()
        elif path == "/metrics":
            if not self._authorized():
                self._json(401, {"error": "missing or wrong API key: send Authorization: Bearer KEY"})
                return
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._json(404, {"error": f"no route {path}: try /health, /ready or /metrics"})

    def _ready(self) -> None:
        if self.server.ready is None:
            self._json(200, {"ready": True})
            return
        try:
            ok = bool(self.server.ready())
        except Exception as exc:
            self._json(503, {"ready": False, "reason": f"{type(exc).__name__}: {exc}"[:300]})
            return
        self._json(200 if ok else 503, {"ready": ok})

    def _authorized(self) -> bool:
        if not self.server.api_key:
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.server.api_key}".encode())

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Silent: probes every few seconds would drown the service's own JSON logs."""


def start_health_server(
    host: str = "127.0.0.1",
    port: int = 0,
    ready: Callable[[], bool] | None = None,
    *,
    registry: CollectorRegistry | None = None,
    api_key: str = "",
    info: Callable[[], dict[str, Any]] | None = None,
) -> tuple[HealthServer, int]:
    """Serve /health, /ready and /metrics on host:port (0: a free port) in a daemon thread.

    Returns the server (call `.close()` on shutdown) and the port it listens on.
    """
    server = HealthServer((host, port), ready, REGISTRY if registry is None else registry, api_key, info)
    server.thread = threading.Thread(target=server.serve_forever, name="squall-health", daemon=True)
    server.thread.start()
    return server, int(server.server_address[1])

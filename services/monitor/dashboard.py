"""The dashboard app: one static page and the JSON it polls.

- `GET /`           the page (services/monitor/static/index.html: plain JS, inline SVG, no CDN)
- `GET /api/state`  monitor.snapshot_json.snapshot() of the run, JSON (the page polls it every 1.5 s),
                    stalls (monitor.stalls) included: the page shows them as a red banner
- `GET /trajectories` and `/api/trajectories`, `/api/trajectory/KEY`, `/api/group/ID`: the
                    trajectory viewer (monitor.viewer)
- `GET /health`     liveness; `GET /metrics` Prometheus (queue lag and ledger included)

With an API key, /api/state and /metrics want `Authorization: Bearer KEY`; the page takes
the key from its own URL (`/?key=KEY`) and sends it as that header.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from squall.monitor.metrics import QueueCollector
from squall.shared.config import RunConfig
from squall.shared.keys import Keys

from .snapshot_json import snapshot
from .stalls import StallCollector, thresholds_for
from .trajectories import TrajectoryView, resolve_dirs
from .viewer import add_viewer_routes

STATIC = Path(__file__).parent / "static"


def create_app(r: redis.Redis, keys: Keys, *, api_key: str = "", config: Any = None) -> FastAPI:
    app = FastAPI(title=f"squall dashboard ({keys.run})", docs_url=None, redoc_url=None, openapi_url=None)
    thresholds = thresholds_for(r, keys, config if config is not None else RunConfig())
    registry = CollectorRegistry()
    registry.register(QueueCollector(r, keys))
    registry.register(StallCollector(r, keys, thresholds))

    def authorized(request: Request) -> bool:
        if not api_key:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def refused() -> JSONResponse:
        return JSONResponse(
            {"error": "missing or wrong API key: open the page as /?key=KEY"}, status_code=401
        )

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/state")
    def state(request: Request) -> JSONResponse:
        if not authorized(request):
            return refused()
        try:
            body = snapshot(r, keys, thresholds)
        except redis.RedisError as exc:  # show "Redis unreachable" on the page, keep serving
            return JSONResponse(
                {"run": keys.run, "error": f"redis: {type(exc).__name__}: {exc}"[:300]}, status_code=503
            )
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    run_dir, model_dir = resolve_dirs(r, keys, config or RunConfig(), None, None)
    advantage = config.trainer.advantage if config is not None else "grpo"
    add_viewer_routes(app, TrajectoryView(r, keys, run_dir, model_dir, advantage), authorized, refused)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "run": keys.run}

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        if not authorized(request):
            return refused()
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

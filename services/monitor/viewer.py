"""The dashboard's trajectory viewer: its page and JSON routes (data from monitor.trajectories).

- `GET /trajectories`                the page (static/trajectories.html)
- `GET /api/trajectories?version=&group=&status=&ledger=&mode=&min_reward=&max_reward=&limit=`
- `GET /api/trajectory/{key}`        one attempt, turn by turn (404 naming where it looked)
- `GET /api/group/{group_id}`        a group's members side by side

The JSON routes take the dashboard's API key like /api/state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from .trajectories import LIST_LIMIT, Filters, NotFound, TrajectoryView, jsonable

STATIC = Path(__file__).parent / "static"


def _number(request: Request, name: str, kind: type) -> Any:
    raw = request.query_params.get(name, "")
    if raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"query parameter {name}={raw!r} is not a{'n integer' if kind is int else ' number'}"
        ) from None


def add_viewer_routes(
    app: FastAPI,
    view: TrajectoryView,
    authorized: Callable[[Request], bool],
    refused: Callable[[], JSONResponse],
) -> None:
    def answer(request: Request, read: Callable[[], dict[str, Any]]) -> JSONResponse:
        if not authorized(request):
            return refused()
        try:
            return JSONResponse(jsonable(read()), headers={"Cache-Control": "no-store"})
        except NotFound as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)

    @app.get("/trajectories")
    def page() -> FileResponse:
        return FileResponse(STATIC / "trajectories.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/trajectories")
    def listing(request: Request) -> JSONResponse:
        def read() -> dict[str, Any]:
            q = request.query_params
            filters = Filters(
                version=_number(request, "version", int),
                group=q.get("group") or None,
                status=q.get("status") or None,
                ledger=q.get("ledger") or None,
                mode=q.get("mode") or None,
                min_reward=_number(request, "min_reward", float),
                max_reward=_number(request, "max_reward", float),
            )
            limit = _number(request, "limit", int) or LIST_LIMIT
            return view.list(filters, min(limit, LIST_LIMIT))

        return answer(request, read)

    @app.get("/api/trajectory/{key}")
    def detail(key: str, request: Request) -> JSONResponse:
        return answer(request, lambda: view.detail(key))

    @app.get("/api/group/{group_id}")
    def group(group_id: str, request: Request) -> JSONResponse:
        return answer(request, lambda: view.group(group_id))

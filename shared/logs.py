"""Structured JSON logs: one event per line, rendered with orjson, starting with identity."""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure_logging(
    service: str, run: str, *, level: str = "INFO", json: bool = True, **identity: Any
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to service and run."""
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        if json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service, run=run, **identity)
    return structlog.get_logger()


def get_logger(**bound: Any) -> Any:
    return structlog.get_logger().bind(**bound)

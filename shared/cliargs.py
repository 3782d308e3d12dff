"""Options every service command shares, and turning them into a validated RunConfig."""

from __future__ import annotations

import argparse
from typing import Any

from .config import RunConfig, load_config


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="RUN_FILE", help="run config file (TOML or YAML)")
    parser.add_argument("--run", metavar="NAME", help="run name (overrides run.name)")
    parser.add_argument("--redis-url", metavar="URL", help="Redis URL (overrides run.redis_url)")


def config_from_args(args: argparse.Namespace, **sections: dict[str, Any]) -> RunConfig:
    """Config file <- environment <- command-line flags (given as section overrides)."""
    overrides: dict[str, dict[str, Any]] = {name: dict(fields) for name, fields in sections.items()}
    run = overrides.setdefault("run", {})
    if getattr(args, "run", None):
        run["name"] = args.run
    if getattr(args, "redis_url", None):
        run["redis_url"] = args.redis_url
    cleaned = {name: {k: v for k, v in fields.items() if v is not None} for name, fields in overrides.items()}
    return load_config(getattr(args, "config", None), overrides=cleaned)

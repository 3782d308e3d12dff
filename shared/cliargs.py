"""Options every service command shares, flags that set one config field, and turning them
into a validated RunConfig."""

from __future__ import annotations

import argparse
import re
import typing
from typing import Any

from .config import RunConfig, load_config

# argparse dest of a flag that sets a config field: "field:<section>.<name>"
FIELD_DEST = "field:"


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="RUN_FILE", help="run config file (TOML or YAML)")
    parser.add_argument("--run", metavar="NAME", help="run name (overrides run.name)")
    parser.add_argument("--redis-url", metavar="URL", help="Redis URL (overrides run.redis_url)")


def field_info(field: str) -> Any:
    """The pydantic FieldInfo of `section.name` in RunConfig."""
    section, _, name = field.partition(".")
    return RunConfig.model_fields[section].annotation.model_fields[name]  # type: ignore[union-attr]


def add_field_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    field: str,
    help: str | None = None,
    **kwargs: Any,
) -> None:
    """`flag` sets config field `section.name`, over the file and the environment.

    Its help is the field's docstring (first sentence) unless given, followed by the field and
    its default, both read from the model: a default is written once, in shared/config.py.
    The type (int, float, a Literal's choices) comes from the field's annotation too.
    """
    info = field_info(field)
    text = help or _first_sentence(info.description or "")
    default = info.get_default(call_default_factory=True)
    annotation = info.annotation
    if "action" not in kwargs:
        kwargs.setdefault("metavar", flag.lstrip("-").replace("-", "_").upper())
        if typing.get_origin(annotation) is typing.Literal:
            kwargs.setdefault("choices", typing.get_args(annotation))
        elif annotation in (int, float):
            kwargs.setdefault("type", annotation)
    shown = f"{default!r}" if default not in ("", [], {}, None) else "unset"
    parser.add_argument(
        flag, dest=FIELD_DEST + field, default=None, help=f"{text} ({field}; default {shown})", **kwargs
    )


def _first_sentence(text: str) -> str:
    return " ".join(re.split(r"(?<=[a-z0-9)])\. (?=[A-Z])", " ".join(text.split()))[0].split()).rstrip(".")


def field_flags(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Sections of the config fields the flags of add_field_flag set (those given)."""
    sections: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if dest.startswith(FIELD_DEST) and value is not None:
            section, _, name = dest[len(FIELD_DEST) :].partition(".")
            sections.setdefault(section, {})[name] = value
    return sections


def config_from_args(args: argparse.Namespace, **sections: dict[str, Any]) -> RunConfig:
    """Config file <- environment <- command-line flags (add_field_flag's, then `sections`)."""
    overrides: dict[str, dict[str, Any]] = field_flags(args)
    for name, fields in sections.items():
        overrides.setdefault(name, {}).update({k: v for k, v in fields.items() if v is not None})
    run = overrides.setdefault("run", {})
    if getattr(args, "run", None):
        run["name"] = args.run
    if getattr(args, "redis_url", None):
        run["redis_url"] = args.redis_url
    cleaned = {name: {k: v for k, v in fields.items() if v is not None} for name, fields in overrides.items()}
    return load_config(getattr(args, "config", None), overrides=cleaned)

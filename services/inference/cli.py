"""`squall inference`: serve a model over an OpenAI-compatible API with hot weight reload.

Reads the `inference` (and `model`, `run`) config sections; flags override them.
Heavy modules (torch, transformers, fastapi) load only in main().
"""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments, add_field_flag, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_field_flag(parser, "--model", "model.path", metavar="DIR")
    add_field_flag(parser, "--backend", "inference.backend")
    add_field_flag(parser, "--host", "inference.host")
    add_field_flag(parser, "--port", "inference.port")
    add_field_flag(
        parser,
        "--api-key",
        "inference.api_key",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1/*; prefer the environment variable "
        "SQUALL_INFERENCE__API_KEY (or inference.api_key in the config), since a key on the "
        "command line is visible to every user in `ps`",
    )
    add_field_flag(parser, "--node", "inference.node", metavar="ID")
    add_field_flag(parser, "--served-name", "inference.model_name", metavar="NAME")
    add_field_flag(parser, "--device", "inference.device")
    add_field_flag(
        parser,
        "--no-follow",
        "inference.follow_weights",
        action="store_const",
        const=False,
        help="do not follow the weights stream (no Redis)",
    )
    add_field_flag(parser, "--pin-version", "inference.pin_version", metavar="K")
    add_field_flag(parser, "--behind", "inference.behind_versions", metavar="N")
    add_common_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from squall.shared.logs import configure_logging

    config = config_from_args(args)
    section = config.inference
    configure_logging(
        "inference",
        config.run.name,
        level=config.run.log_level,
        node=section.node or f"{section.host}:{section.port}",
    )
    from squall.inference.node import run

    return run(config)

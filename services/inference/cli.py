"""`squall inference`: serve a model over an OpenAI-compatible API with hot weight reload.

Reads the `inference` (and `model`, `run`) config sections; flags override them.
Heavy modules (torch, transformers, fastapi) load only in main().
"""

from __future__ import annotations

import argparse

from squall.shared.cliargs import add_common_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="DIR", help="model directory (transformers format); default model.path"
    )
    parser.add_argument("--backend", choices=("torch", "vllm"), help="inference backend (default torch)")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require Authorization: Bearer KEY on /v1/*; prefer the environment variable "
        "SQUALL_INFERENCE__API_KEY (or inference.api_key in the config), since a key on the "
        "command line is visible to every user in `ps`",
    )
    parser.add_argument("--node", metavar="ID", help="node id in weights:applied (default host:port)")
    parser.add_argument(
        "--served-name", metavar="NAME", help="model name clients ask for (default model.name)"
    )
    parser.add_argument("--device", help="torch device: auto, cpu, cuda, cuda:1 ...")
    parser.add_argument(
        "--no-follow", action="store_true", help="do not follow the weights stream (no Redis)"
    )
    parser.add_argument(
        "--pin-version",
        type=int,
        metavar="K",
        help="serve exactly published weight version K and never another (a policy snapshot, "
        "e.g. a self-play opponent)",
    )
    parser.add_argument(
        "--behind", type=int, metavar="N", help="serve the version N behind the newest published one"
    )
    add_common_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from squall.shared.logs import configure_logging

    inference = {
        "backend": args.backend,
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "node": args.node,
        "model_name": args.served_name,
        "device": args.device,
        "follow_weights": False if args.no_follow else None,
        "pin_version": args.pin_version,
        "behind_versions": args.behind,
    }
    config = config_from_args(args, inference=inference, model={"path": args.model})
    section = config.inference
    configure_logging(
        "inference",
        config.run.name,
        level=config.run.log_level,
        node=section.node or f"{section.host}:{section.port}",
    )
    from .node import run

    return run(config)

"""`squall optimize --algorithm apo --config RUN`: optimise a resource (a system prompt) of the run."""

from __future__ import annotations

import argparse
import sys

from squall.shared.cliargs import add_common_arguments, add_field_flag

EXIT_CONFIG = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_field_flag(parser, "--algorithm", "optimizer.algorithm")
    add_field_flag(parser, "--resource", "optimizer.resource")
    add_field_flag(parser, "--editor-url", "optimizer.editor_url")
    add_field_flag(parser, "--editor-model", "optimizer.editor_model")
    add_field_flag(parser, "--rounds", "optimizer.rounds")
    add_field_flag(parser, "--beam-width", "optimizer.beam_width")


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.config import OPTIMIZER_ALGORITHMS
    from squall.shared.errors import ConfigError, RedisUnavailable
    from squall.shared.logs import configure_logging
    from squall.shared.redisconn import connect

    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"squall optimize: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    section = config.optimizer
    if not section.algorithm:
        print(
            f"squall optimize: no algorithm: give --algorithm (known: {', '.join(OPTIMIZER_ALGORITHMS)})",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    editor_url = section.editor_url or (config.runner.inference_urls[0].rstrip("/") + "/v1")
    configure_logging("optimizer", config.run.name, level=config.run.log_level)
    from .optimizer import Optimizer

    try:
        r = connect(config.run.redis_url, autostart=config.run.autostart_redis)
        return Optimizer(config, r, editor_url=editor_url).run()
    except ConfigError as exc:
        print(f"squall optimize: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except RedisUnavailable as exc:
        print(f"squall optimize: {exc}", file=sys.stderr)
        return 3

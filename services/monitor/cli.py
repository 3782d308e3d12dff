"""`squall dashboard`: serve the live web dashboard of one run.

Use the `squall-monitor` Redis user (read-only; `squall acl` writes its env file):
    squall dashboard --run demo --redis-url redis://squall-monitor:SECRET@host:6379/0 --port 8787
"""

from __future__ import annotations

import argparse
import os

from squall.shared.cliargs import add_common_arguments, config_from_args

DEFAULT_PORT = 8787


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"listen port (default {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SQUALL_DASHBOARD_API_KEY", ""),
        help="require this bearer key for /api/state and /metrics (env SQUALL_DASHBOARD_API_KEY)",
    )


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from squall.shared.keys import Keys
    from squall.shared.logs import configure_logging
    from squall.shared.redisconn import connect, redact

    from .dashboard import create_app

    config = config_from_args(args)
    log = configure_logging("dashboard", config.run.name, level=config.run.log_level)
    r = connect(config.run.redis_url)  # never autostart: a dashboard watches an existing run
    app = create_app(r, Keys(config.run.name), api_key=args.api_key, config=config)
    log.info("dashboard_started", url=f"http://{args.host}:{args.port}/", redis=redact(config.run.redis_url))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    log.info("dashboard_stopped")
    return 0

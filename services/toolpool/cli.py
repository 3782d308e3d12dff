"""`squall worker --config RUN [--workers N] [--queues code,sql] [--http-port P]`: the tool pool.

Starts N rq workers (child processes, restarted when one dies) on the run's tool queues and,
with --http-port, the HTTP front for external agents. More capacity: a bigger N, or more
`squall worker` anywhere that reaches the Redis. `rq info --url REDIS` shows the queues.
"""

from __future__ import annotations

import argparse
import sys

from squall.shared.cliargs import add_common_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument(
        "--queues",
        help="comma-separated tools to serve (overrides worker.queues): code, retrieval, sql, judge",
    )
    parser.add_argument("--workers", type=int, help="rq worker processes (overrides worker.workers)")
    parser.add_argument("--http-port", type=int, help="also serve the tools over HTTP on this port")
    parser.add_argument("--burst", action="store_true", help="exit once the queues are empty (tests, batch)")
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)  # one rq worker, in-process
    parser.add_argument("--http-only", action="store_true", help=argparse.SUPPRESS)  # the HTTP front only


def main(args: argparse.Namespace) -> int:
    from squall.shared.cliargs import config_from_args
    from squall.shared.logs import configure_logging

    worker: dict = {"workers": args.workers, "http_port": args.http_port}
    if args.queues:
        worker["queues"] = [q.strip() for q in args.queues.split(",") if q.strip()]
    config = config_from_args(args, worker=worker)
    configure_logging("worker", config.run.name, level=config.run.log_level)
    tools = list(config.worker.queues)
    if args.http_only:
        return _serve_http(config)
    if not tools:
        print(
            "squall worker: no queues: set worker.queues in the run file or pass --queues code,sql,...",
            file=sys.stderr,
        )
        return 2
    if args.single:
        from squall.toolpool.pool import work_one

        return work_one(config, tools, burst=args.burst)
    return _supervise(args, config, tools)


def _serve_http(config) -> int:  # type: ignore[no-untyped-def]
    from squall.shared.redisconn import connect
    from squall.toolpool.client import Tools
    from squall.toolpool.http import serve

    r = connect(config.run.redis_url, autostart=False)
    serve(Tools(r, config.run.name, config.worker), config.worker.http_host, config.worker.http_port)
    return 0


def _supervise(args: argparse.Namespace, config, tools: list[str]) -> int:  # type: ignore[no-untyped-def]
    import json
    import signal
    import threading

    from squall.toolpool.pool import Supervisor

    base = [sys.executable, "-m", "squall.cli", "worker", "--run", config.run.name]
    if args.config:
        base += ["--config", args.config]
    # The URL through the environment, not argv: it may hold a password, and argv is public.
    env = {"SQUALL_RUN__REDIS_URL": config.run.redis_url, "SQUALL_WORKER__QUEUES": json.dumps(tools)}
    burst = ["--burst"] if args.burst else []
    pool = Supervisor([*base, "--single", *burst], config.worker.workers, env, burst=args.burst)
    http = None
    if config.worker.http_port:
        http = Supervisor(
            [*base, "--http-only"], 1, {**env, "SQUALL_WORKER__HTTP_PORT": str(config.worker.http_port)}
        )
    signal.signal(signal.SIGTERM, lambda *_: (pool.stop(), http and http.stop()))
    signal.signal(signal.SIGINT, lambda *_: (pool.stop(), http and http.stop()))
    print(
        f"squall worker: run {config.run.name!r}: {config.worker.workers} rq worker(s) on {', '.join(tools)}"
        + (f"; HTTP on {config.worker.http_host}:{config.worker.http_port}" if http else ""),
        file=sys.stderr,
        flush=True,
    )
    front = threading.Thread(target=http.run, daemon=True) if http is not None else None
    if front is not None:
        front.start()
    code = pool.run()
    if http is not None and front is not None:
        http.stop()
        front.join(timeout=10)
    return code

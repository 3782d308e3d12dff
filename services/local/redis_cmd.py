"""`squall redis`: run a local Redis-compatible server in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=6379, help="port on 127.0.0.1 (default 6379)")
    parser.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    parser.add_argument(
        "--aof", action="store_true", help="persist with an append-only file (needs --dir to survive)"
    )


def main(args: argparse.Namespace) -> int:
    from squall.shared.localredis import LocalRedis, find_server_binary

    server = LocalRedis(port=args.port, data_dir=args.dir, aof=args.aof).start()
    print(
        f"squall redis: {find_server_binary()} serving {server.url} (data {server.data_dir}, aof={'on' if args.aof else 'off'})",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        if server.process is not None and server.process.poll() is not None:
            print(f"squall redis: server exited with {server.process.returncode}", flush=True)
            return 1
    server.close()
    return 0

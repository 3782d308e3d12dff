"""Child service processes for `squall up`: started in their own session (so Ctrl-C reaches
only the orchestrator, which then stops them in order), tied to the orchestrator's life with
PR_SET_PDEATHSIG (so even kill -9 of `squall up` leaves no orphan), logs to a file each."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


@dataclass
class ServiceProcess:
    """One `squall <command>` child."""

    name: str  # e.g. runner-1; also the log file's name
    args: list[str]  # arguments after `squall`
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> ServiceProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it for its whole life
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "squall.cli", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_child_setup if sys.platform.startswith("linux") else None,
        )
        log.close()
        return self

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, deadline_s: float) -> int | None:
        """Wait up to `deadline_s`; SIGKILL if still alive. Returns the exit code."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=max(deadline_s, 0.0))
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop_all(processes: list[ServiceProcess], grace_s: float) -> dict[str, int | None]:
    """SIGTERM every process, give them `grace_s` together, SIGKILL the rest."""
    for proc in processes:
        proc.terminate()
    end = time.monotonic() + grace_s
    return {proc.name: proc.wait(end - time.monotonic()) for proc in processes}

"""Child service processes for `squall up`: started in their own session (so Ctrl-C reaches
only the orchestrator, which then stops them in order), tied to the orchestrator's life with
PR_SET_PDEATHSIG (so even kill -9 of `squall up` leaves no orphan), logs to a file each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from squall.shared.supervision import die_with_parent, stop


def _child_setup() -> None:
    die_with_parent(signal.SIGKILL, required=False)


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

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stop_all(processes: list[ServiceProcess], grace_s: float) -> dict[str, int | None]:
    """SIGTERM every process, give them `grace_s` together, SIGKILL the rest."""
    started = {proc.name: proc.process for proc in processes if proc.process is not None}
    codes = dict(zip(started, stop(list(started.values()), grace_s), strict=True))
    return {proc.name: codes.get(proc.name) for proc in processes}


def stop_in_stages(
    stages: list[list[ServiceProcess]], grace_s: float | list[float], deadline_s: float
) -> dict[str, int | None]:
    """Stop `stages` one after the other: SIGTERM a stage, wait until all of it has exited (at
    most its grace: `grace_s`, or `grace_s[i]` for stage i; SIGKILL the rest), then the next. The
    whole stop ends by `deadline_s`: a later stage gets what is left (at least a second to exit on
    its own). Draining in order lets runners hand back their work while the inference they wait
    on still answers, and the trainer checkpoint while Redis and the scheduler are still there."""
    graces = grace_s if isinstance(grace_s, list) else [grace_s] * len(stages)
    if len(graces) != len(stages):
        raise ValueError(f"stop_in_stages: {len(stages)} stages but {len(graces)} grace periods")
    end = time.monotonic() + deadline_s
    codes: dict[str, int | None] = {}
    for stage, grace in zip(stages, graces, strict=True):
        left = max(end - time.monotonic(), 1.0)
        codes.update(stop_all(stage, min(grace, left)))
    return codes

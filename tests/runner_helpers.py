"""Helpers for the scheduler/runner/gateway tests: squall subprocesses, waiting, data files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from squall.shared import bus, schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

TESTS_DIR = Path(__file__).parent
SQUALL = [sys.executable, "-m", "squall.cli"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class Procs:
    """Squall subprocesses of one test, all stopped (killed if need be) at teardown."""

    def __init__(self, redis_url: str, run: str, tmp: Path, **env: str) -> None:
        self.redis_url, self.run, self.tmp = redis_url, run, tmp
        self.env = {
            **os.environ,
            "PYTHONPATH": f"{TESTS_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1",
            "SQUALL_RUN__LOG_LEVEL": "WARNING",
            **env,
        }
        self.procs: list[subprocess.Popen] = []

    def start(self, command: str, *args: str, **env: str) -> subprocess.Popen:
        log = open(self.tmp / f"{command}-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*SQUALL, command, "--run", self.run, "--redis-url", self.redis_url, *args],
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def log_of(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text()  # type: ignore[attr-defined]


def trajectories(r: redis.Redis, run: str) -> list[schemas.Trajectory]:
    return [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(Keys(run).trajectories)]


def tasks(r: redis.Redis, run: str) -> list[schemas.Task]:
    out = []
    for _, fields in r.xrange(Keys(run).tasks):
        try:
            out.append(schemas.decode(fields[schemas.ENTRY_FIELD]))
        except Exception:
            continue
    return out


def events(r: redis.Redis, run: str, name: str | None = None) -> list[schemas.Event]:
    found = [schemas.decode(f[schemas.ENTRY_FIELD]) for _, f in r.xrange(Keys(run).events)]
    return [e for e in found if name is None or e.name == name]


def dispatch(r, run, rows, *, deadline_s=60.0):
    """XADD one single-member task per row and put it in the ledger, as the scheduler does."""
    keys, ledger = Keys(run), Ledger(r, Keys(run))
    bus.ensure_group(r, keys.tasks, "runners")
    sent = []
    for i, row in enumerate(rows):
        task = schemas.Task(run=run, task_id=f"g{i}:0", group_id=f"g{i}", sample_id=str(i), index=0,
                            group_size=1, payload=row, deadline=time.time() + deadline_s)  # fmt: skip
        bus.publish(r, keys.tasks, task)
        ledger.move([task.key], "pending", allowed_from=("new",))
        sent.append(task)
    return sent


def continuation_expected(tokenizer, earlier, later) -> bool:
    """Should the gateway mark `later` as extending `earlier`? Exactly when `earlier`'s prompt +
    reply re-tokenise to the ids sampled and `later`'s prompt renders them unchanged. A tiny
    model's random reply sometimes re-tokenises differently (docs/runner.md: those turns become
    separate samples), so a test asserts this rather than assuming every reply survives."""
    joined = earlier.prompt_tokens.tolist() + earlier.response_tokens.tolist()
    text = tokenizer.decode(joined, skip_special_tokens=False)
    later_text = tokenizer.decode(later.prompt_tokens.tolist(), skip_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False) == joined and later_text.startswith(text)

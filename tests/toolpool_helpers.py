"""A real `squall worker` for tests: started as a subprocess, waited for, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import redis
from rq import Queue, Worker

from squall.shared.config import WorkerSection
from squall.toolpool.client import Tools
from squall.toolpool.queues import queue_name
from tests.waiting import wait_for


def section(settings: dict[str, str]) -> WorkerSection:
    """The WorkerSection the pool's environment variables describe (for the test's client)."""
    fields = {k.removeprefix("SQUALL_WORKER__").lower(): v for k, v in settings.items()}
    return WorkerSection(**{k: json.loads(v) if v[:1] in "[{" else v for k, v in fields.items()})


@contextlib.contextmanager
def running_pool(redis_url: str, run: str, settings: dict[str, str], log: Path,
                 args: tuple[str, ...] = ("--workers", "1")) -> Iterator[dict]:  # fmt: skip
    env = {**os.environ, **settings, "SQUALL_RUN__REDIS_URL": redis_url, "SQUALL_RUN__NAME": run,
           "SQUALL_RUN__AUTOSTART_REDIS": "false", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "squall.cli", "worker", *args], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    r = redis.Redis.from_url(redis_url)
    tools = Tools(r, run, section(settings))
    first = json.loads(settings["SQUALL_WORKER__QUEUES"])[0]
    try:
        queue = Queue(queue_name(run, first), connection=r)
        wait_for(
            lambda: Worker.count(queue=queue) >= 1 or process.poll() is not None, 60, "a registered rq worker"
        )
        assert process.poll() is None, log.read_text()[-3000:]
        yield {"r": r, "tools": tools, "process": process, "log": log}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

"""One rq worker process of the pool, and the supervisor that keeps N of them running.

`work_one` is what each child runs: settings into `jobs.configure` (retrieval indexes built
before rq forks its work horses), then rq's Worker on the run's tool queues with JSON jobs,
the configured result TTL and a short maintenance interval (abandoned jobs of a dead worker
are failed or retried within `maintenance_s`). `Supervisor` starts the children in their own
process groups with PDEATHSIG, restarts one that dies (after a pause), and on SIGTERM passes
it on (rq: finish the current job, then exit), waits `grace_s`, then SIGKILLs the groups.

Why not rq's WorkerPool (rq 3.0): it builds each Worker with fixed arguments (no result TTL,
maintenance or monitoring interval, worker TTL; always with the scheduler), never SIGKILLs a
worker that does not stop, and forks the workers from the pool process, so nothing dies with a
killed pool. Why PoolWorker still overrides two Worker methods: rq has no public setting for the
60 s it adds to a job's heartbeat TTL (how late a dead worker's job is seen as abandoned), nor a
hook that runs in the work horse before the job (where PDEATHSIG must be set).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from squall.shared.config import RunConfig
from squall.shared.supervision import die_with_parent, stop
from squall.toolpool import jobs
from squall.toolpool.queues import queue_name, rq_connection, serializer

RESTART_PAUSE_S = 1.0  # before restarting a worker that died
GRACE_S = 30.0  # SIGTERM -> SIGKILL for the children


def _pool_worker_class() -> type:
    from rq import Worker

    class PoolWorker(Worker):
        """rq's forking Worker whose work horse dies with it: a worker killed with -9 leaves no
        horse (nor, through the sandbox's own PDEATHSIG, sandboxed code) running on."""

        def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:  # type: ignore[no-untyped-def]
            # rq's own margin is a fixed 60 s: a dead worker's job would wait that long to be
            # seen as abandoned. Three heartbeats are enough (the worker renews every one).
            return int(self.job_monitoring_interval) * 3

        def main_work_horse(self, job, queue):  # type: ignore[no-untyped-def]
            die_with_parent(signal.SIGKILL)
            if os.getppid() == 1:  # the worker died between fork and prctl
                os._exit(1)
            return super().main_work_horse(job, queue)

    return PoolWorker


def work_one(config: RunConfig, tools: list[str], name: str | None = None, burst: bool = False) -> int:
    """Run one rq worker on `tools` until SIGTERM (or, with `burst`, until the queues are empty)."""
    from rq import Queue

    from squall.shared.redisconn import connect

    settings = config.worker
    jobs.configure(settings)
    r = rq_connection(connect(config.run.redis_url, autostart=False))
    queues = [Queue(queue_name(config.run.name, t), connection=r, serializer=serializer()) for t in tools]
    worker = _pool_worker_class()(
        queues,
        connection=r,
        name=name,
        serializer=serializer(),
        default_result_ttl=settings.result_ttl_s,
        maintenance_interval=settings.maintenance_s,
        job_monitoring_interval=settings.heartbeat_s,
        # rq waits worker_ttl - 15 s for a job and runs maintenance only between waits, so an idle
        # worker fails a dead worker's job within maintenance_s; its own entry (rq info,
        # pool_summary) expires maintenance_s + 15 s after it died, not rq's 420 s.
        worker_ttl=settings.maintenance_s + 15,
    )
    worker.work(burst=burst, logging_level=config.run.log_level, with_scheduler=False)
    return 0


def _child_setup() -> None:
    os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL)


@dataclass
class Supervisor:
    """Keeps `count` children of `argv` running until `stop()`."""

    argv: list[str]  # command of one child
    count: int
    env: dict[str, str] = field(default_factory=dict)
    children: list[subprocess.Popen | None] = field(default_factory=list)
    burst: bool = False  # children that exit 0 are done (not restarted); run() ends when all are
    restarts: int = 0
    stopping: threading.Event = field(default_factory=threading.Event)

    def _spawn(self, slot: int) -> subprocess.Popen:
        env = {**os.environ, **self.env, "SQUALL_WORKER_SLOT": str(slot)}
        return subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, preexec_fn=_child_setup)

    def run(self, poll_s: float = 0.5) -> int:
        self.children = [self._spawn(i) for i in range(self.count)]
        died_at: dict[int, float] = {}
        while not self.stopping.wait(poll_s):
            if self.burst and all(c is None or c.poll() == 0 for c in self.children):
                break
            for slot, child in enumerate(self.children):
                if child is None or child.poll() is None or (self.burst and child.returncode == 0):
                    continue
                died_at.setdefault(slot, time.monotonic())
                if time.monotonic() - died_at[slot] >= RESTART_PAUSE_S:
                    print(
                        f"squall worker: worker {slot} exited with {child.returncode}; restarting",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.children[slot] = self._spawn(slot)
                    self.restarts += 1
                    del died_at[slot]
        return self._shutdown()

    def stop(self, *_: object) -> None:
        self.stopping.set()

    def _shutdown(self, grace_s: float = GRACE_S) -> int:
        alive = [c for c in self.children if c is not None and c.poll() is None]
        stop(alive, grace_s, kill_group=True)  # SIGTERM the worker; SIGKILL its group (horse, sandbox)
        return 0

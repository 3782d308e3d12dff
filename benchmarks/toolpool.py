"""The tool pool's numbers: jobs/s of `squall worker` for a trivial job and for a sandboxed
`print(1)`, with 1 and 4 rq workers, the round trip of one call (enqueue -> result) and the
sandbox's start-up cost on its own.

    .venv/bin/python benchmarks/toolpool.py [--jobs 300] [--sandbox-runs 50]

Throughput: N jobs enqueued at once (one pipeline), timed from the first enqueue until the
last result; each job runs in a work horse rq forks per job, so this is rq's per-job cost plus
the job. Round trip: sequential client calls (client.Tools.call), median. Start-up: median of
`sandbox.run_python("pass")` in this process (fork, confinement, exec of python -I -S, exit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import redis
from rq import Queue, Worker

from squall.shared.config import WorkerSection
from squall.shared.localredis import LocalRedis
from squall.toolpool.client import Tools
from squall.toolpool.queues import FUNCTIONS, PING, queue_name, serializer
from squall.toolpool.sandbox import run_python

RUN = "bench"


def start_pool(url: str, workers: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": url,
        "SQUALL_RUN__NAME": RUN,
        "SQUALL_WORKER__QUEUES": '["code"]',
    }
    process = subprocess.Popen([sys.executable, "-m", "squall.cli", "worker", "--workers", str(workers)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    r = redis.Redis.from_url(url)
    end = time.monotonic() + 60
    while Worker.count(queue=Queue(queue_name(RUN, "code"), connection=r)) < workers:
        if time.monotonic() > end:
            raise RuntimeError("the pool did not start")
        time.sleep(0.1)
    return process


def stop_pool(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def throughput(r: redis.Redis, func: str, kwargs: dict, n: int) -> float:
    queue = Queue(queue_name(RUN, "code"), connection=r, serializer=serializer())
    finished = queue.finished_job_registry
    baseline = r.zcard(finished.key)
    started = time.perf_counter()
    jobs = queue.enqueue_many([Queue.prepare_data(func, kwargs=kwargs, result_ttl=60) for _ in range(n)])
    assert len(jobs) == n
    end = time.monotonic() + 600
    while True:
        done = r.zcard(finished.key) - baseline
        if done >= n:
            break
        if time.monotonic() > end:
            raise RuntimeError(f"only {done} of {n} jobs finished")
        time.sleep(0.01)
    return n / (time.perf_counter() - started)


def round_trip(tools: Tools, func: str, kwargs: dict, n: int) -> float:
    """Median ms of one call as an agent makes it: enqueue, then block on the result stream."""
    queue = Queue(queue_name(RUN, "code"), connection=tools.r, serializer=serializer())
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        job = queue.enqueue_call(func, kwargs=kwargs, result_ttl=60)
        tools._wait(job, "code", time.monotonic() + 30, 30)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--sandbox-runs", type=int, default=50)
    args = parser.parse_args()
    startup = [run_python("pass").duration_s for _ in range(args.sandbox_runs)]
    results: dict = {"sandbox_startup_ms_p50": round(statistics.median(startup) * 1000, 1),
                     "sandbox_startup_ms_p90": round(sorted(startup)[int(0.9 * len(startup))] * 1000, 1)}  # fmt: skip
    server = LocalRedis().start()
    try:
        r = redis.Redis.from_url(server.url)
        for workers in (1, 4):
            r.flushdb()
            pool = start_pool(server.url, workers)
            try:
                tools = Tools(r, RUN, WorkerSection(queues=["code"]))
                results[f"trivial_jobs_per_s_{workers}w"] = round(
                    throughput(r, PING, {"value": 1}, args.jobs), 1
                )
                results[f"print1_jobs_per_s_{workers}w"] = round(
                    throughput(r, FUNCTIONS["code"], {"code": "print(1)"}, args.jobs), 1
                )
                if workers == 1:
                    results["trivial_round_trip_ms_p50"] = round(round_trip(tools, PING, {"value": 1}, 30), 1)
                    results["print1_round_trip_ms_p50"] = round(
                        round_trip(tools, FUNCTIONS["code"], {"code": "print(1)"}, 30), 1
                    )
            finally:
                stop_pool(pool)
    finally:
        server.close()
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

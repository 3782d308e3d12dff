"""Runner benchmarks: the gateway's per-call overhead and dispatch-to-trajectory throughput.

    .venv/bin/python benchmarks/runner.py [--calls 300] [--tasks 2000] [--runners 1,2,4]

1. Gateway overhead: one runner process whose agent (in the runner's own event loop, as a
   real Python agent is) alternates the same one-message request sent to the gateway as Chat
   Completions, Anthropic Messages and OpenAI Responses, and straight to the inference node
   (tiny model, max_tokens=1), and reports p50/p90/p99 of each and of the paired differences.
   Same process, same run, same moment: the node's own noise cancels in the pairing.
2. Throughput: K runner processes (concurrency 16 each) with a trivial agent (no LLM);
   N tasks are XADDed at once and we time until N trajectories are in the stream.
Prints one JSON object; docs/runner.md keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent


# --- agents (imported by the runner subprocess as `runner:...`) ----------------------------
async def overhead_agent(task: dict, llm) -> float:
    import httpx

    body = {
        "model": llm.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    gateway, direct = f"{llm.base_url}/chat/completions", f"{task['direct']}/v1/chat/completions"
    # direct_ids: straight to the node but asking for ids and logprobs as the gateway does, so
    # gateway - direct_ids is the hop alone and direct_ids - direct the server's extra work.
    with_ids = {**body, "return_token_ids": True, "logprobs": True}
    messages = {"model": llm.model, "max_tokens": 1, "temperature": 0, "messages": body["messages"]}
    responses = {"model": llm.model, "max_output_tokens": 1, "temperature": 0, "input": "hi"}
    targets = [("gateway", gateway, body), ("direct", direct, body), ("direct_ids", direct, with_ids),
               ("gateway_messages", f"{llm.base_url}/messages", messages),
               ("gateway_responses", f"{llm.base_url}/responses", responses)]  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    async with httpx.AsyncClient(timeout=30) as client:
        for i in range(task["calls"] + 20):
            order = targets[i % len(targets) :] + targets[: i % len(targets)]
            for name, url, payload in order:
                start = time.perf_counter()
                response = await client.post(url, json=payload)
                elapsed = time.perf_counter() - start
                response.raise_for_status()
                if i >= 20:  # warm-up done
                    samples[name].append(elapsed * 1000)
    Path(task["out"]).write_text(json.dumps(samples))
    return 1.0


async def trivial_agent(task: dict, llm) -> float:
    return 1.0


# --- harness ------------------------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(BENCH_DIR),
        "OMP_NUM_THREADS": "1",
        "SQUALL_RUN__LOG_LEVEL": "WARNING",
    }


def _runner(redis_url: str, run: str, agent: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "squall.cli",
            "runner",
            "--run",
            run,
            "--redis-url",
            redis_url,
            "--agent",
            agent,
            *extra,
        ],
        env=_env(),
    )


def _dispatch(r, run: str, n: int) -> None:
    from squall.shared import bus, schemas
    from squall.shared.keys import Keys
    from squall.shared.ledger import Ledger

    keys, ledger = Keys(run), Ledger(r, Keys(run))
    bus.ensure_group(r, keys.tasks, "runners")
    deadline = time.time() + 600
    tasks = [
        schemas.Task(
            run=run,
            task_id=f"g{i}:0",
            group_id=f"g{i}",
            sample_id=str(i),
            index=0,
            group_size=1,
            payload={"i": i},
            deadline=deadline,
        )  # fmt: skip
        for i in range(n)
    ]
    pipe = r.pipeline(transaction=True)
    for task in tasks:
        pipe.xadd(keys.tasks, {schemas.ENTRY_FIELD: schemas.encode(task)})
    ledger.move_in(pipe, [t.key for t in tasks], "pending", allowed_from=("new",))
    pipe.execute()


def _wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise TimeoutError(f"timed out waiting for {what}")


def bench_overhead(redis_url: str, calls: int, tmp: Path) -> dict:
    import httpx

    from squall.inference.tiny import build_tiny_model
    from squall.shared import schemas
    from squall.shared.keys import Keys
    from squall.shared.localredis import free_port

    model = build_tiny_model(tmp / "tiny")
    port = free_port()
    inference = subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "inference", "--model", str(model), "--port", str(port), "--no-follow"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    run = "bench-overhead"
    import redis

    r = redis.Redis.from_url(redis_url)
    runner = None
    try:
        _wait(lambda: _healthy(httpx, url), 120, "inference")
        runner = _runner(
            redis_url, run, "runner:overhead_agent", "--inference-url", url, "--concurrency", "1"
        )
        out = tmp / "overhead.json"
        from squall.shared import bus

        keys = Keys(run)
        bus.ensure_group(r, keys.tasks, "runners")
        task = schemas.Task(run=run, task_id="o:0", group_id="o", sample_id="o", index=0, group_size=1,
                            payload={"direct": url, "calls": calls, "out": str(out)}, deadline=time.time() + 900)  # fmt: skip
        bus.publish(r, keys.tasks, task)
        _wait(lambda: r.xlen(keys.trajectories) >= 1, 900, "the overhead agent")
        samples = json.loads(out.read_text())
    finally:
        if runner is not None:
            runner.terminate()
            runner.wait(20)
        inference.terminate()
        inference.wait(20)
    result: dict = {"calls": calls}
    for name, values in samples.items():
        result[f"{name}_ms"] = {
            "p50": round(_percentile(values, 0.5), 3),
            "p90": round(_percentile(values, 0.9), 3),
            "p99": round(_percentile(values, 0.99), 3),
        }
    for base in ("direct", "direct_ids"):
        diffs = [g - d for g, d in zip(samples["gateway"], samples[base], strict=True)]
        result[f"added_ms_vs_{base}"] = {"p50_of_pairs": round(statistics.median(diffs), 3)}
    # Per protocol: what the gateway adds over the node's own call with ids and logprobs.
    for name in ("gateway", "gateway_messages", "gateway_responses"):
        diffs = [g - d for g, d in zip(samples[name], samples["direct_ids"], strict=True)]
        result[f"{name}_added_ms"] = {
            "p50": round(statistics.median(diffs), 3),
            "p99": round(_percentile(diffs, 0.99), 3),
        }
    return result


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def bench_throughput(redis_url: str, n_tasks: int, n_runners: int) -> dict:
    import redis

    from squall.shared.keys import Keys

    r = redis.Redis.from_url(redis_url)
    run = f"bench-tp{n_runners}"
    keys = Keys(run)
    r.delete(*[k for k in r.keys(f"squall:{run}:*")] or ["none"])
    runners = [
        _runner(redis_url, run, "runner:trivial_agent", "--concurrency", "16") for _ in range(n_runners)
    ]
    try:
        _wait(lambda: r.hlen(keys.heartbeats) >= n_runners, 60, "runners up")
        start = time.perf_counter()
        _dispatch(r, run, n_tasks)
        _wait(lambda: r.xlen(keys.trajectories) >= n_tasks, 600, "every trajectory")
        seconds = time.perf_counter() - start
    finally:
        for proc in runners:
            proc.terminate()
        for proc in runners:
            proc.wait(30)
    return {
        "runners": n_runners,
        "tasks": n_tasks,
        "seconds": round(seconds, 3),
        "per_s": round(n_tasks / seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="paired calls for the overhead benchmark")
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per throughput measurement")
    parser.add_argument("--runners", default="1,2,4", help="runner process counts to measure")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    from squall.shared.localredis import LocalRedis

    server = LocalRedis().start()
    result: dict = {"machine": f"{os.cpu_count()} cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_overhead:
            result["gateway_overhead"] = bench_overhead(server.url, args.calls, Path(tmp))
        counts = [int(k) for k in args.runners.split(",") if k]
        result["throughput"] = [bench_throughput(server.url, args.tasks, k) for k in counts]
    server.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

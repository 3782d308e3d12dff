"""The whole loop's throughput and the async speed-up, measured in one call.

`squall up` runs the same run twice (or once per value of `--staleness`): synchronous
(`scheduler.max_dispatch_lag = 0`: no rollout may start on weights older than the trainer's newest) and
with the configured staleness (rollouts go on while the trainer trains). Both runs get the
same data, runners, model and device, and their own Redis keys on one Redis this script starts.

For each run, over the window from the first task dispatched to the last optimizer step:
- trajectories/s       trajectories finished (the `trajectories` stream's entries-added)
- generated tok/s      tokens sampled by the inference nodes (their /metrics, scraped)
- trainer utilisation  the sum of the trainer's `time/train_s` over the window
- steps, versions, and the wall time of the whole `squall up` (model loads included)
The last line is the async speed-up: trajectories/s at the configured staleness divided by
trajectories/s at staleness 0.

    .venv/bin/python benchmarks/loop.py                                   # CPU, demo config
    python benchmarks/loop.py --device cuda --runners 4 --concurrency 64 --samples 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from squall.shared import schemas
from squall.shared.keys import Keys
from squall.shared.localredis import LocalRedis, free_port
from squall.shared.runstate import decode_entry

GENERATED = re.compile(r"^squall_inference_generated_tokens_total\s+([0-9.e+]+)", re.M)
UP_DEADLINE_S = 1800.0  # one `squall up` of this benchmark; past it the run is killed and reported


class Watcher(threading.Thread):
    """Samples one run while it goes: when the first task was dispatched, and the inference
    node's generated-token counter (the node dies with `squall up`, so the last scrape counts)."""

    def __init__(self, redis_url: str, keys: Keys, metrics_url: str) -> None:
        super().__init__(daemon=True)
        import redis

        self.r, self.keys, self.metrics_url = redis.Redis.from_url(redis_url), keys, metrics_url
        self.first_task_at: float | None = None
        self.generated = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.first_task_at is None and self.r.exists(self.keys.tasks):
                first = self.r.xrange(self.keys.tasks, count=1)
                if first:
                    self.first_task_at = int(first[0][0].split(b"-")[0]) / 1000
            try:
                text = httpx.get(self.metrics_url, timeout=2).text
                match = GENERATED.search(text)
                if match:
                    self.generated = max(self.generated, float(match.group(1)))
            except httpx.HTTPError:
                pass  # not up yet, or already gone
            self.done.wait(1.0)


def run_once(args: argparse.Namespace, redis_url: str, staleness: int, root: Path) -> dict:
    name = f"loop-s{staleness}-{os.getpid()}"
    keys, port = Keys(name), free_port()
    env = {
        **os.environ,
        "SQUALL_RUN__NAME": name,
        "SQUALL_RUN__DIR": str(root / name),
        "SQUALL_RUN__REDIS_URL": redis_url,
        "SQUALL_SCHEDULER__MAX_SAMPLES": str(args.samples),
        "SQUALL_SCHEDULER__MAX_DISPATCH_LAG": str(staleness),
        "SQUALL_TRAINER__MAX_SAMPLE_AGE": str(staleness),
        "SQUALL_SCHEDULER__VAL_EVERY": "0",  # throughput only: no validation rounds
        "SQUALL_SCHEDULER__VAL_AT_END": "false",
        "SQUALL_RUNNER__CONCURRENCY": str(args.concurrency),
        "SQUALL_TRAINER__DEVICE": args.device,
        "SQUALL_INFERENCE__DEVICE": args.device,
    }
    if args.model:
        env["SQUALL_MODEL__PATH"] = args.model
    cmd = [sys.executable, "-m", "squall.cli", "up", "--config", args.config, "--label", "loop"]
    cmd += ["--runners", str(args.runners), "--base-port", str(port)]
    watcher = Watcher(redis_url, keys, f"http://127.0.0.1:{port}/metrics")
    watcher.start()
    started = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=UP_DEADLINE_S)
    finally:
        watcher.done.set()
        watcher.join(5)
    wall = time.time() - started
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"squall up (staleness {staleness}) exited {proc.returncode}")
    return measure(watcher, keys, staleness, wall)


def measure(watcher: Watcher, keys: Keys, staleness: int, wall: float) -> dict:
    r = watcher.r
    steps = [decode_entry(fields, schemas.Metrics) for _, fields in r.xrange(keys.metrics)]
    steps = [m for m in steps if m is not None]
    if not steps or watcher.first_task_at is None:
        raise SystemExit(f"staleness {staleness}: the run trained no step; see its logs under {keys.run}")
    window = steps[-1].time - watcher.first_task_at
    trajectories = int(r.xinfo_stream(keys.trajectories)["entries-added"])
    train_s = sum(m.values.get("time/train_s", 0.0) for m in steps)
    return {
        "staleness": staleness,
        "window_s": round(window, 2),
        "wall_s": round(wall, 2),
        "steps": steps[-1].step,
        "version": steps[-1].version,
        "trajectories": trajectories,
        "trajectories_per_s": trajectories / window,
        "generated_tokens_per_s": watcher.generated / window,
        "trainer_utilisation": train_s / window,
        "reward_first": steps[0].values.get("reward_mean"),
        "reward_last": steps[-1].values.get("reward_mean"),
    }


def ensure_data(config: str) -> None:
    """The demo's data, written the way `make demo` writes it, when the config's file is missing."""
    from squall.shared.config import load_config

    dataset = Path(load_config(config).scheduler.dataset)
    if dataset.exists():
        return
    subprocess.run(
        [sys.executable, "-m", "examples.calc.tasks", "--out", str(dataset.parent), "--train", "4000",
         "--val", "200", "--seed", "0"],
        check=True,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="examples/calc/demo.toml")
    parser.add_argument("--model", help="policy folder (default: the config's model.path)")
    parser.add_argument("--device", default="cpu", help="trainer and inference device: cpu | cuda")
    parser.add_argument("--samples", type=int, default=48, help="training problems per run")
    parser.add_argument("--runners", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16, help="episodes in flight per runner")
    parser.add_argument(
        "--staleness",
        default="0,1",
        help="comma-separated max_dispatch_lag (and max_sample_age) values, 0 first",
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    ensure_data(args.config)
    values = [int(v) for v in args.staleness.split(",")]
    redis = LocalRedis().start()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="squall-loop-") as tmp:
            for staleness in values:
                rows.append(run_once(args, redis.url, staleness, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        redis.close()
    print(f"\nsquall up, {args.config}, device {args.device}, {args.runners} runners x {args.concurrency}, "
          f"{args.samples} problems per run")  # fmt: skip
    print("staleness | traj/s | gen tok/s | trainer util | steps | window s | wall s")
    for row in rows:
        print(f"{row['staleness']:>9} | {row['trajectories_per_s']:6.2f} | {row['generated_tokens_per_s']:9.0f} | "
              f"{row['trainer_utilisation']:12.2f} | {row['steps']:5d} | {row['window_s']:8.1f} | {row['wall_s']:6.1f}")  # fmt: skip
    if len(rows) > 1 and rows[0]["staleness"] == 0:
        for row in rows[1:]:
            speedup = row["trajectories_per_s"] / rows[0]["trajectories_per_s"]
            print(f"async speed-up (staleness {row['staleness']} vs 0, trajectories/s): {speedup:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`squall track`'s catch-up cost: one poll over a run of N trainer steps (metrics, 8
trajectories and 8 train reward points per step, a validation point every other step),
per backend and all three at once, on a private Redis, W&B offline, MLflow file store.

    .venv/bin/python benchmarks/tracking.py [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tracking_helpers

import redis  # noqa: E402

from squall.shared.keys import Keys  # noqa: E402
from squall.shared.localredis import LocalRedis  # noqa: E402
from squall.tracking.track import Tracker  # noqa: E402
from tests.tracking_helpers import publish_steps, tracking_config  # noqa: E402

SETS = (["tensorboard"], ["mlflow"], ["wandb"], ["tensorboard", "mlflow", "wandb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_SILENT", "true")
    tmp = Path(tempfile.mkdtemp(prefix="squall-track-bench-"))
    server = LocalRedis(data_dir=tmp / "redis").start()
    try:
        r = redis.Redis.from_url(server.url)
        for backends in SETS:
            run = "bench-" + "-".join(backends)
            publish_steps(r, Keys(run), range(1, args.steps + 1), per_version=8)
            config = tracking_config(tmp / run, run, server.url, backends, wandb_mode="offline")
            start = time.perf_counter()
            tracker = Tracker(config, r)
            opened = time.perf_counter()
            counts = tracker.poll()
            polled = time.perf_counter()
            tracker.close()
            print(
                f"{'+'.join(backends):28s} open {opened - start:5.2f} s  poll {polled - opened:5.2f} s  {counts}"
            )
    finally:
        server.close()


if __name__ == "__main__":
    main()

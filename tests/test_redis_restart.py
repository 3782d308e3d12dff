"""A Redis restart in the middle of `squall up`: the run rides through it and finishes.

Redis runs with AOF on, on a port of the test's own; `squall up` finds it answering and uses
it. Once the trainer has published a few versions the test sends SHUTDOWN (Redis writes its
AOF and exits), waits 2 s, and starts Redis again on the same port and folder. Every service
sees connection errors, waits for Redis (shared/retry.py) and goes on. The run must finish
the dataset, the ledger must balance with nothing left in flight, and no key may appear
twice in trained.jsonl (exactly-once training across the outage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from waiting import wait_for

from squall.shared.keys import Keys
from squall.shared.localredis import LocalRedis, free_port
from squall.shared.runstate import read_snapshot

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"
RUN = "calc-restart"
DOWN_S = 2.0  # how long Redis stays away

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def trained_keys(run_dir: Path) -> list[str]:
    lines = (run_dir / "trained.jsonl").read_text().splitlines()
    return [key for line in lines if line.strip() for key in json.loads(line)["keys"]]


def shutdown(r: redis.Redis) -> None:
    """SHUTDOWN: Redis writes its AOF and exits (redis-py sees the connection close)."""
    try:
        r.shutdown(nosave=False)
    except redis.ConnectionError:
        pass


@pytest.mark.timeout(900)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the demo policy is not built")
def test_run_rides_through_a_redis_restart(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "examples.calc.tasks", "--out", str(data), "--train", "64",
                    "--val", "16", "--seed", "0"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    port, redis_dir, run_dir = free_port(), tmp_path / "redis", tmp_path / "run"
    server = LocalRedis(port=port, data_dir=redis_dir, aof=True).start()
    env = {
        **os.environ,
        "SQUALL_RUN__NAME": RUN,
        "SQUALL_RUN__REDIS_URL": server.url,
        "SQUALL_RUN__AUTOSTART_REDIS": "false",
        "SQUALL_RUN__REDIS_OUTAGE_S": "60",
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__MAX_SAMPLES": "48",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "16",
        "SQUALL_SCHEDULER__VAL_EVERY": "100",
    }
    out_path = tmp_path / "up.log"
    with open(out_path, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "squall.cli", "up", "--config", "examples/calc/demo.toml", "--minutes", "9"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    r = redis.Redis.from_url(server.url)
    keys = Keys(RUN)
    try:
        # Mid-run: the trainer has published a few versions and work is in flight. Both are read
        # from one snapshot: right after a publish the scheduler may not yet have dispatched the
        # next groups, and an outage then would hit an idle bus.
        def live_snapshot():
            snap = read_snapshot(r, keys, rewards=0, metrics=0)
            return snap if (snap.versions.trainer or 0) >= 3 and snap.ledger.in_flight > 0 else None

        before = wait_for(live_snapshot, timeout_s=300, what="trainer version 3 with work in flight",
                          interval=0.2).ledger  # fmt: skip
        shutdown(r)
        server.close()
        time.sleep(DOWN_S)
        server = LocalRedis(port=port, data_dir=redis_dir, aof=True).start()
        code = up.wait(timeout=480)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        log = out_path.read_text(errors="replace")
        server.close()
    assert before.in_flight > 0, before  # the outage hit a live run
    assert code == 0, log[-4000:]
    assert "scheduler finished the dataset" in log, log[-4000:]
    assert "unclean exits" not in log, log[-4000:]
    # The scheduler and the trainer each saw the outage and rode it out (shared/retry.py logs it).
    for service in ("scheduler", "trainer"):
        text = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob(f"{service}*"))
        assert "redis_outage" in text and "redis_back" in text, (service, text[-2000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["ledger"]
    assert summary["ledger_balanced"], ledger
    assert not {k: v for k, v in ledger.items() if k in ("pending", "running")}, ledger
    keys_trained = trained_keys(run_dir)
    twice = [k for k, n in Counter(keys_trained).items() if n > 1]
    assert keys_trained and not twice, twice
    assert ledger.get("trained", 0) == len(keys_trained), (ledger, len(keys_trained))

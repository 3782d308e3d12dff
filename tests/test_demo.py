"""A shortened `make demo` (fixed seed, a few minutes): the whole system on the real policy.

All services start and stop cleanly and leave no process behind, weight versions advance on
the inference node, the ledger adds up with every attempt accounted for, and the training
reward of the last groups beats the first ones by a margin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from squall.shared.localredis import free_port

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"
SETTLED = {"trained", "validated", "late", "deadlettered", "cancelled", "retried"}

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def leftover_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


@pytest.mark.timeout(780)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the demo policy is not built")
def test_short_demo_learns_and_shuts_down_cleanly(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "examples.calc.tasks", "--out", str(data), "--train", "400",
                    "--val", "64", "--seed", "0"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # a private embedded Redis
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__MAX_SAMPLES": "96",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "32",
        "SQUALL_SCHEDULER__VAL_EVERY": "6",
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/calc/demo.toml", "--minutes", "8"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=720,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "scheduler finished the dataset" in out, out[-3000:]
    assert "unclean exits" not in out, out[-3000:]
    assert "demo: val_reward_start=" in out
    assert not leftover_processes(str(run_dir)), "services outlived squall up"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    # Weight versions advanced on the inference node, not only in the trainer.
    assert summary["versions"]["inference:node0"] >= 10, summary["versions"]
    # Conservation: every dispatched attempt is in exactly one state, none left in flight.
    ledger = summary["ledger"]
    assert summary["ledger_balanced"], ledger
    in_flight = {k: v for k, v in ledger.items() if k in ("pending", "running")}
    assert not in_flight, ledger
    accounted = sum(v for k, v in ledger.items() if k in SETTLED or k.startswith("filtered:") or k == "ok")
    assert accounted == ledger["dispatched"], ledger
    # Learning: the last quarter of training groups beats the first quarter.
    rewards = [point["mean"] for point in summary["train_curve"]]
    quarter = max(4, len(rewards) // 4)
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last >= first + 0.15, (first, last, rewards)

"""A short `squall up` on the real model (SmolLM2-135M-Instruct) with the calc_real agent:
the mechanics (attempts through the model's own tool calls, a trainer step on the real model,
publication, a node serving the new version) and the ledger. The learning target lives in the
example's run (examples/calc_real/README.md), not in this timed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runner_helpers import write_jsonl

from examples.calc_real.tasks import generate
from squall.shared import schemas
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

pytestmark = [pytest.mark.slow, pytest.mark.realmodel, pytest.mark.redis, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


def test_up_on_the_real_model_trains_publishes_and_balances_the_ledger(
    tmp_path,
    r,
    redis_url,
    run_name,
    real_model,
):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": redis_url,
        "SQUALL_RUN__NAME": run_name,
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_MODEL__PATH": str(real_model),
        "SQUALL_SCHEDULER__DATASET": str(write_jsonl(tmp_path / "train.jsonl", generate("train", 4, 0))),
        "SQUALL_SCHEDULER__VAL_DATASET": str(write_jsonl(tmp_path / "val.jsonl", generate("val", 2, 0))),
        "SQUALL_SCHEDULER__GROUP_SIZE": "4",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "2",
        "SQUALL_SCHEDULER__VAL_EVERY": "1",
        "SQUALL_TRAINER__GROUPS_PER_STEP": "1",
        "SQUALL_TORCH_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/calc_real/real.toml", "--runners", "1",
         "--minutes", "10", "--label", "real"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "scheduler finished the dataset" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    keys = Keys(run_name)
    assert summary["ledger_balanced"] and Ledger(r, keys).balanced(), summary["ledger"]
    assert "ok" not in Ledger(r, keys).counts()
    # Every attempt went through the model: its trajectories hold real turns with sampled ids.
    trajectories = [
        schemas.decode(f[schemas.ENTRY_FIELD], schemas.Trajectory) for _, f in r.xrange(keys.trajectories)
    ]
    assert trajectories and all(t.turns for t in trajectories if t.status == "ok")
    states = {v.decode() for v in r.hgetall(keys.attempts).values()}
    assert states <= {"trained", "validated", "retried", "deadlettered"} | {
        s for s in states if s.startswith("filtered:")
    }
    if summary["steps"]:  # a group with reward variance trained: it was published and served
        last = summary["trainer_last_version"]
        published = [
            schemas.decode(f[schemas.ENTRY_FIELD], schemas.WeightVersion) for _, f in r.xrange(keys.weights)
        ]
        assert published[-1].version == last and len(published[-1].checksum) == 64
        applied = [
            schemas.decode(f[schemas.ENTRY_FIELD], schemas.WeightApplied)
            for _, f in r.xrange(keys.weights_applied)
        ]
        assert last in {a.version for a in applied}  # the node checked the sha256 before serving it
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        import math

        assert all(math.isfinite(m["loss"]) for m in metrics)

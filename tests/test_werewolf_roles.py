"""Werewolf with both teams learning (examples/werewolf/roles.toml), end to end through
`squall up`: two roles trained in one trainer, served by one inference node as two adapters,
each measured on held-out games against the warm start. It needs an inference node that serves
roles by name (issue 22's node side); on a tree without one it is skipped, saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.werewolf import game as rules
from squall.shared.localredis import free_port

ROOT = Path(__file__).resolve().parents[1]
NODE_SERVES_ROLES = importlib.util.find_spec("squall.inference.weights.catalog") is not None

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not NODE_SERVES_ROLES, reason="the inference node does not serve roles by name yet"),
    pytest.mark.skipif(not (ROOT / "examples" / "werewolf" / "policy" / "config.json").exists(),
                       reason="the werewolf warm start is not built"),
]  # fmt: skip


@pytest.mark.timeout(600)  # its own subprocess budget, past the suite-wide 300 s
def test_both_teams_train_and_each_is_measured_against_the_warm_start(tmp_path):
    data = tmp_path / "data"
    rules.main(["--out", str(data), "--train", "400", "--val", "40", "--seed", "0"])
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # a private embedded Redis
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__MAX_SAMPLES": "32",  # 8 steps of each role
        "SQUALL_SCHEDULER__VAL_SAMPLES": "24",
        "SQUALL_SCHEDULER__VAL_EVERY": "3",  # at the start and every 3 versions (a loaded machine may cut the end)
        "WEREWOLF_LEAGUE_FRACTION": "0.25",  # and the league option on: snapshots of version 0
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/werewolf/roles.toml",
         "--minutes", "7", "--label", "werewolf-roles"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "unclean exits" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger_balanced"], summary["ledger"]
    versions = summary["versions"]
    for role in ("villagers", "wolves"):
        assert versions[f"trainer:{role}"] >= 3, versions  # each role published its own versions
        assert versions[f"inference:node0:{role}"] >= 1, versions  # and the node applied them
        curve = summary["roles"][role]["val_curve"]
        assert len(curve) >= 2 and all(0.0 <= p["mean"] <= 1.0 and p["count"] == 24 for p in curve), curve
    assert "trainer" not in versions  # no `policy` role in this run
    assert (run_dir / "learning_curve.png").stat().st_size > 1000

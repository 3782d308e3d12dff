"""benchmarks/race.py's mechanics on the real model, a step or two per trainer: squall (async)
and TRL's GRPOTrainer each leave checkpoints, the one shared evaluator scores the base model and
a checkpoint of each, and the PNG and race.json are written. Not a speed or learning claim
(the race itself is `python benchmarks/race.py`, docs/performance.md).

Optional suite 'race': TRL lives in its own venv (`make test-race` builds it and runs this).
Groups of 4 and one group per step (through the SQUALL_* variables, which both trainers read)
keep it to a couple of minutes. The same mechanics with `--device cuda` run where a CUDA GPU is
(optional suite 'gpu' as well): both trainers and the evaluator on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import need, need_trl
from tests.realmodel import real_model  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # a few minutes on a quiet machine; generous for a loaded one
def test_race_harness_trains_both_and_scores_both(real_model: Path, tmp_path: Path) -> None:  # noqa: F811
    report = race_one_step(real_model, tmp_path, "cpu")
    assert report["device"] == "cpu"


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_race_harness_on_a_cuda_gpu(real_model: Path, tmp_path: Path) -> None:  # noqa: F811
    import torch

    need("gpu", torch.cuda.is_available(), "no CUDA GPU here (torch.cuda.is_available() is False)")
    report = race_one_step(real_model, tmp_path, "cuda")
    assert report["device"] == "cuda"
    assert report["repeats"][0]["trl"]["device"] == torch.cuda.get_device_name(0)  # TRL saw the GPU
    trainer_log = (tmp_path / "race" / "squall_async" / "run" / "logs" / "trainer.log").read_text()
    assert '"device":"cuda' in trainer_log, trainer_log[-2000:]  # so did squall's trainer


def race_one_step(real_model: Path, tmp_path: Path, device: str) -> dict:  # noqa: F811
    """The harness for one step of squall (async) and of TRL on `device`; checks the mechanics
    and returns race.json."""
    python = need_trl()
    env = {
        **os.environ,
        "SQUALL_TRL_PYTHON": python,
        "SQUALL_SCHEDULER__GROUP_SIZE": "4",
        "SQUALL_SCHEDULER__MAX_INFLIGHT_GROUPS": "1",
        "SQUALL_TRAINER__GROUPS_PER_STEP": "1",
        "RACE_NICE": "0",
    }
    out = tmp_path / "race"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "race.py"), "--model", str(real_model), "--out", str(out),
        "--minutes", "4", "--max-steps", "1", "--train", "16", "--val", "2", "--evals", "1",
        "--contenders", "squall_async,trl", "--target", "0.5", "--device", device,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "race.json").read_text())
    assert report["params"]["group_size"] == 4 and report["params"]["groups_per_step"] == 1
    for name in ("squall_async", "trl"):
        run = report["repeats"][0][name]
        assert run["checkpoints"], f"{name} left no checkpoint"
        ckpt = Path(run["checkpoints"][-1]["path"])
        assert (ckpt / "config.json").is_file() and any(ckpt.glob("*.safetensors")), (
            f"{name}: {ckpt} is no HF folder"
        )
        # the base model at t=0, then the evaluated checkpoint: rewards are the task's grades
        assert len(run["curve"]) == 2 and run["curve"][1][0] > 0
        assert all(0.0 <= reward <= 1.0 for _, reward in run["curve"])
        assert run["peak_rss"] > 100 * 2**20 and run["tokens_per_s"] > 0
    assert (
        report["repeats"][0]["squall_async"]["curve"][0] == report["repeats"][0]["trl"]["curve"][0]
    )  # one base score
    assert (out / "race.png").stat().st_size > 5000
    assert "no race line" in done.stdout  # two contenders of three: the race line needs all three
    return report

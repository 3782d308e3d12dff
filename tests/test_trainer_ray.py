"""The trainer on a Ray cluster (Ray Train, 2 CPU workers, gloo) against one process: the
whole `squall trainer --ray --workers 2` on a real Redis trains the same first step as
`squall trainer` alone, and publishes the same weights; a cluster address nobody answers at
is refused quickly, saying what to do."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed_helpers import free_port
from test_trainer_e2e import ROOT, prepared_run, start_trainer
from test_trainer_step import make_tiny_model
from waiting import reap

from squall.shared.weightfiles import version_dir

pytestmark = [pytest.mark.redis, pytest.mark.slow]
torch.set_num_threads(1)


def published_weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(version_dir(run_dir, version).glob("*.safetensors")):
        out.update(load_file(str(path)))
    assert out, f"no weights published in {version_dir(run_dir, version)}"
    return out


def one_step(tmp_path: Path, r, redis_url: str, run_name: str, model_path: Path, *launch: str) -> Path:
    """`squall trainer --max-steps 1` (plus `launch`) on a fresh copy of the e2e dataset; the run dir."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    *_, config = prepared_run(tmp_path, r, redis_url, run_name, model_path)
    proc = start_trainer(config, "--max-steps", "1", *launch)
    try:
        rc = proc.wait(420)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-4000:]
    return tmp_path / "run"


def test_two_ray_workers_step_equals_one_process(tmp_path, r, redis_url, run_name):
    model_path = make_tiny_model(tmp_path / "model")
    single = one_step(tmp_path / "single", r, redis_url, run_name, model_path)
    on_ray = one_step(tmp_path / "ray", r, redis_url, f"{run_name}ray", model_path, "--ray", "--workers", "2")
    from safetensors.torch import load_file

    before = load_file(str(model_path / "model.safetensors"))
    want, got = published_weights(single, 1), published_weights(on_ray, 1)
    assert max(float((want[k] - before[k]).abs().max()) for k in before) > 1e-5  # the step moved them
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    assert (on_ray / "ray").is_dir()  # Ray Train's run folder: the ranks ran as Ray workers ...
    assert list(on_ray.glob("checkpoints/**/rng-00001.pt"))  # ... two of them: rank 1 saved its part


def test_unreachable_ray_address_is_refused_quickly(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "noray"\ndir = "{tmp_path / "run"}"\n[trainer]\ndevice = "cpu"\n')
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "squall.cli", "trainer", "--config", str(config), "--ray-address", address,
         "--workers", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"no Ray cluster answers at {address!r}" in proc.stderr and "ray start --head" in proc.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything started

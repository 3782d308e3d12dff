"""The torch trainer at world size 2 (two real processes, gloo, FSDP2) against one process:
the same step gives the same weights and metrics; a sharded checkpoint round trip resumes
the exact trajectory of updates; a launch asking for more GPUs than there are, and a
checkpoint of another world size, fail with errors that say what to do."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_helpers import assert_weights_close, run_world
from test_trainer_e2e import assert_trained_once, prepared_run, start_trainer, trained_log
from test_trainer_step import config_for, make_tiny_model, step_batch
from waiting import reap, wait_for

from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import decode
from squall.trainer.backend import make_backend
from squall.trainer.checkpoint import CheckpointStore, TrainerState, WorldSizeMismatch
from squall.trainer.distributed import WorldSizeError, check_devices
from squall.trainer.launch_torchrun import rank_environment, rank_processes, torchrun_command

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
MICROBATCH_TOKENS = 40  # the batch below splits into an odd number of micro-batches
RTOL = 1e-5


def train_once(tmp_dir, model_path, samples, trainer):
    """One step on a fresh backend: (metrics, full weights) — the weights on rank 0 only."""
    backend = make_backend("torch", config_for(Path(tmp_dir), model_path, **trainer))
    metrics = backend.train_step(samples)
    return metrics, backend.weights()


def train_save_resume(tmp_dir, model_path, samples, trainer):
    """Step, checkpoint, step again; then a fresh backend loads the checkpoint and takes the
    second step again. Both second steps must give the same weights."""
    first_half, second_half = samples[: len(samples) // 2], samples[len(samples) // 2 :]
    config = config_for(Path(tmp_dir), model_path, **trainer)
    backend = make_backend("torch", config)
    backend.train_step(first_half)
    ckpt = Path(tmp_dir) / "ckpt" / "state.pt"  # the name CheckpointStore gives it: a folder here
    backend.save_state(ckpt)
    backend.train_step(second_half)
    straight = backend.weights()
    resumed = make_backend("torch", config)
    resumed.load_state(ckpt)
    resumed.train_step(second_half)
    return straight, resumed.weights(), sorted(p.name for p in ckpt.iterdir())


@pytest.mark.slow  # two gloo ranks plus one process: 15-25 s each on 2 cores (make test-fast skips them)
@pytest.mark.parametrize(
    "trainer",
    [{"loss_agg": "token"}, {"loss_agg": "trajectory", "kl_coef": 0.1}],
    ids=["token", "trajectory+kl"],
)
def test_two_ranks_step_equals_one_process(tmp_path, trainer):
    model_path = make_tiny_model(tmp_path / "model")
    samples = step_batch(model_path)
    trainer = {**trainer, "max_tokens_per_microbatch": MICROBATCH_TOKENS}
    single_metrics, single_weights = train_once(tmp_path / "single", model_path, samples, trainer)
    assert single_metrics["microbatches"] % 2 == 1  # one rank runs a zero-weight filler

    (metrics0, weights0), (metrics1, weights1) = run_world(
        train_once, str(tmp_path / "ranks"), str(model_path), samples, trainer
    )
    assert weights1 == {}  # the full state dict is gathered to rank 0 only
    before = make_backend("torch", config_for(tmp_path, model_path)).weights()
    moved = max(float((single_weights[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the step changed the weights: the comparison below means something
    # Against the update, not the weights: Adam's first step divides by the gradient's own size,
    # so two summation orders differ by a few 1e-5 of the update (2.7e-5 on this CPU, measured),
    # while a wrong sum across ranks would be off by a large part of it.
    assert_weights_close(single_weights, weights0, rel=1e-4, before=before)
    for metrics in (metrics0, metrics1):  # every rank reports the whole step, as one process does
        assert metrics.keys() == single_metrics.keys()
        for name, value in single_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=RTOL, abs=1e-7), name


@pytest.mark.slow  # two gloo ranks, saved and resumed: ~25 s on 2 cores
def test_sharded_checkpoint_resumes_the_same_updates(tmp_path):
    model_path = make_tiny_model(tmp_path / "model")
    samples = step_batch(model_path)
    trainer = {"max_tokens_per_microbatch": MICROBATCH_TOKENS}
    (straight, resumed, files), _ = run_world(
        train_save_resume, str(tmp_path / "ranks"), str(model_path), samples, trainer
    )
    assert {"rng-00000.pt", "rng-00001.pt", ".metadata"} <= set(files)
    assert sum(name.endswith(".distcp") for name in files) == 2  # one shard file per rank
    assert_weights_close(straight, resumed)


def launch_args(**given):
    base = {"config": "run.toml", "run": None, "redis_url": None, "field:trainer.backend": None, "field:trainer.max_steps": 3,
            "nproc_per_node": 2, "nnodes": 1, "node_rank": None, "rdzv_endpoint": None}  # fmt: skip
    return argparse.Namespace(**{**base, **given})


def test_launch_command_and_its_bad_input():
    single = torchrun_command(launch_args())
    assert single[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert single[-5:] == ["-m", "squall.cli", "trainer", "--config", "run.toml"]
    env = rank_environment(launch_args(run="r1", redis_url="redis://u:secret@h:1/0"))
    assert env["SQUALL_TRAINER__MAX_STEPS"] == "3" and env["SQUALL_RUN__NAME"] == "r1"
    assert env["SQUALL_RUN__REDIS_URL"] == "redis://u:secret@h:1/0"  # not in argv, where ps shows it
    multi = torchrun_command(launch_args(nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400"))
    assert "--rdzv-backend=static" in multi and "--node-rank=1" in multi and "--nnodes=2" in multi
    with pytest.raises(WorldSizeError, match="--node-rank"):
        torchrun_command(launch_args(nnodes=2))
    if torch.cuda.device_count() < 64:
        have = torch.cuda.device_count()
        advice = f"--nproc-per-node {have} or fewer" if have else "run it on a GPU machine"
        with pytest.raises(WorldSizeError, match=f"has {have} CUDA device\\(s\\): {advice}"):
            check_devices("cuda", 64)
    check_devices("cpu", 64)  # CPU ranks are not limited by devices


def launch_two_ranks(config: Path) -> subprocess.CompletedProcess:
    """`squall trainer --config CONFIG --nproc-per-node 2`, to its end (these ones are refused)."""
    return subprocess.run(
        [sys.executable, "-m", "squall.cli", "trainer", "--config", str(config), "--nproc-per-node", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_refuses_more_ranks_than_gpus(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA devices; the check is exercised by the unit test")
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "toomany"\ndir = "{tmp_path / "run"}"\n[trainer]\ndevice = "cuda"\n')
    proc = launch_two_ranks(config)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "0 CUDA device(s): run it on a GPU machine, or set trainer.device = 'cpu'" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before anything started


def test_checkpoint_of_another_world_size_is_refused(tmp_path):
    written = CheckpointStore(tmp_path / "ckpt", world_size=2)
    written.save(TrainerState(commit=1, step=1, version=1, trained={"g:0#0": 1}), lambda p: p.mkdir())
    with pytest.raises(WorldSizeMismatch, match=r"2 rank\(s\), this one has 1: resume it with 2 rank"):
        CheckpointStore(tmp_path / "ckpt", world_size=1).latest()
    state, _ = CheckpointStore(tmp_path / "ckpt", world_size=2).latest()
    assert state.trained == {"g:0#0": 1}
    older = CheckpointStore(tmp_path / "old")  # checkpoints from before the world size was recorded
    older.save(TrainerState(commit=1, step=1, version=1), lambda p: p.write_bytes(b"x"))
    with pytest.raises(WorldSizeMismatch, match="1 rank"):
        CheckpointStore(tmp_path / "old", world_size=2).latest()


# --- the whole trainer at world size 2 (torchrun, a real Redis) -------------------------
def start_ranks(config: Path, *extra: str) -> subprocess.Popen:
    return start_trainer(config, "--nproc-per-node", "2", *extra)


def wait_for_ranks(proc: subprocess.Popen) -> dict[int, int]:
    return wait_for(lambda: len(found := rank_processes(proc.pid)) == 2 and found, 60, "two ranks")


@pytest.mark.redis
@pytest.mark.slow
def test_kill9_of_either_rank_then_resume_trains_every_key_once(tmp_path, r, redis_url, run_name):
    model_path = make_tiny_model(tmp_path / "model")
    keys, trainable, zero_var, config = prepared_run(
        tmp_path, r, redis_url, run_name, model_path, collective_timeout_s=30.0
    )
    run_dir = tmp_path / "run"

    for kill_after, victim in ((2, 1), (5, 0)):  # a follower, then rank 0 (the bus owner)
        proc = start_ranks(config, "--max-steps", "9")
        try:
            pids = wait_for_ranks(proc)
            wait_for(lambda k=kill_after, p=proc: len(trained_log(run_dir)) >= k or p.poll() is not None,
                     180, f"step {kill_after}")  # fmt: skip
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            os.kill(pids[victim], signal.SIGKILL)
            rc = proc.wait(60)  # torchrun tears the survivor down: well within the collective timeout
            assert rc != 0
            assert not rank_processes(proc.pid)
        finally:
            reap(proc)
    proc = start_ranks(config, "--max-steps", "9")
    try:
        rc = proc.wait(300)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-3000:]

    assert assert_trained_once(r, keys, run_dir, trainable, zero_var, steps=9).balanced()
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    assert int(r.hget(keys.versions, "trainer")) == 9
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*"))[-1]
    assert json.loads((newest / "meta.json").read_text())["world_size"] == 2
    assert (newest / "state.pt" / "rng-00001.pt").exists()


@pytest.mark.redis
@pytest.mark.slow
def test_sigterm_stops_every_rank_after_the_step(tmp_path, r, redis_url, run_name):
    model_path = make_tiny_model(tmp_path / "model")
    keys, trainable, _, config = prepared_run(
        tmp_path, r, redis_url, run_name, model_path, collective_timeout_s=30.0
    )
    proc = start_ranks(config)
    try:
        wait_for_ranks(proc)
        wait_for(lambda: trained_log(tmp_path / "run") or proc.poll() is not None, 180, "first step")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(90)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-3000:]
    done = {k for line in trained_log(tmp_path / "run") for k in line["keys"]}
    assert done and done <= trainable
    # every trained entry is acked: what is still pending was never trained
    pending = r.xpending_range(keys.trajectories, GROUP_TRAINER, min="-", max="+", count=1000)
    pending_ids = {row["message_id"] for row in pending}
    trained_ids = {eid for eid, fields in r.xrange(keys.trajectories) if decoded_key(fields) in done}
    assert not pending_ids & trained_ids


def decoded_key(fields) -> str | None:
    try:
        return decode(fields[b"m"]).key
    except Exception:  # the corrupt entry of the dataset
        return None


@pytest.mark.timeout(660)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.redis
@pytest.mark.slow
def test_up_runs_the_trainer_on_two_ranks(tmp_path, r, redis_url, run_name):
    """`squall up --trainer-ranks 2` on the calculator policy: the run trains, publishes and
    stops cleanly, and the ledger agrees with what the ranks trained."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "examples.calc.tasks", "--out", str(data), "--train", "8",
                    "--val", "4", "--seed", "0"], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": redis_url,
        "SQUALL_RUN__NAME": run_name,
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__GROUP_SIZE": "4",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "4",
        "SQUALL_TRAINER__GROUPS_PER_STEP": "2",
        "SQUALL_TORCH_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/calc/demo.toml", "--runners", "1",
         "--trainer-ranks", "2", "--minutes", "8", "--label", "ranks"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "unclean exits" not in out, out[-3000:]
    keys = Keys(run_name)
    ledger = Ledger(r, keys)
    assert ledger.balanced() and "ok" not in ledger.counts(), ledger.counts()
    trained = {k for line in trained_log(run_dir) for k in line["keys"]}
    states = {k.decode(): v.decode() for k, v in r.hgetall(keys.attempts).items()}
    assert trained and {k for k, state in states.items() if state == "trained"} == trained
    assert int(r.hget(keys.versions, "trainer")) >= 1
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*"))[-1]
    assert json.loads((newest / "meta.json").read_text())["world_size"] == 2
    logs = "".join(p.read_text() for p in run_dir.rglob("trainer*.log"))
    assert '"rank_following"' in logs or "rank_following" in logs, "the second rank did not start"


def trainer_args(argv: list[str]) -> argparse.Namespace:
    from squall.trainer.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_deploy_examples_launch_what_they_say():
    """The compose overrides and the systemd launch examples parse as `squall trainer`
    options and give the torchrun launch they describe (GPUs reserved = ranks per node)."""
    import yaml

    deploy = ROOT / "deploy"
    for name, nnodes in (("compose.trainer-8gpu.yaml", 1), ("compose.trainer-2nodes.yaml", 2)):
        trainer = yaml.safe_load((deploy / "containers" / name).read_text())["services"]["trainer"]
        argv = [
            "1" if "SQUALL_NODE_RANK" in a else "10.0.0.1:29400" if "SQUALL_RDZV" in a else a
            for a in trainer["command"][1:]
        ]
        command = torchrun_command(trainer_args(argv))
        (gpus,) = trainer["deploy"]["resources"]["reservations"]["devices"]
        assert f"--nproc-per-node={gpus['count']}" in command, name
        assert (f"--nnodes={nnodes}" in command) == (nnodes > 1), name
    example = (deploy / "systemd" / "env" / "trainer-launch.env.example").read_text()
    launches = [line.lstrip("#").partition("=")[2].split() for line in example.splitlines()
                if line.lstrip("#").startswith("SQUALL_TRAINER_LAUNCH=")]  # fmt: skip
    assert len(launches) == 2
    for launch in launches:
        assert "--nproc-per-node=8" in torchrun_command(trainer_args(["--config", "run.toml", *launch]))
    unit = (deploy / "systemd" / "squall-trainer.service").read_text()
    assert "$SQUALL_TRAINER_LAUNCH" in unit and "EnvironmentFile=-/etc/squall/trainer-launch.env" in unit


def test_launch_refuses_a_checkpoint_of_another_world_size(tmp_path):
    """Checked by the launcher itself: no rank starts (and no model loads) to find out."""
    run_dir = tmp_path / "run"
    CheckpointStore(run_dir / "checkpoints").save(
        TrainerState(commit=1, step=1, version=1), lambda p: p.write_bytes(b"x")
    )
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\nname = "resize"\ndir = "{run_dir}"\n[trainer]\ndevice = "cpu"\n')
    proc = launch_two_ranks(config)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "written by a trainer with 1 rank(s), this one has 2: resume it with 1 rank(s)" in proc.stderr
    assert "torch.distributed.run" not in proc.stderr and "rank_following" not in proc.stderr

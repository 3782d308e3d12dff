"""End to end on a real Redis with a real tiny model: the trainer as a subprocess is
killed with SIGKILL mid-run, restarted, and the trained keys have no gap and no duplicate;
corrupt and out-of-vocab entries are dead-lettered while training goes on; SIGTERM exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optional import need_verl
from test_trainer_step import VOCAB, make_tiny_model, sampled_trajectory
from waiting import reap, wait_for

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, Turn, pack_logprobs, pack_tokens

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path, redis_url, run_name, model_path, **trainer) -> Path:
    settings = {"device": "cpu", "groups_per_step": 1, "lr": 1e-3, "max_sample_age": 1000, "group_wait_s": 60.0,
                "keep_versions": 2, **trainer}  # fmt: skip
    lines = [
        "[run]", f'name = "{run_name}"', f'redis_url = "{redis_url}"', "autostart_redis = false",
        f'dir = "{tmp_path / "run"}"', 'log_level = "WARNING"',
        "[model]", f'path = "{model_path}"', "[trainer]",
        *(f"{k} = {json.dumps(v)}" for k, v in settings.items()),
    ]  # fmt: skip
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_trainer(config: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "squall.cli", "trainer", "--config", str(config), *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def trained_log(run_dir: Path) -> list[dict]:
    path = run_dir / "trained.jsonl"
    if not path.exists():
        return []
    out = []
    for raw in path.read_text().splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            pass
    return out


def assert_trained_once(
    r, keys: Keys, run_dir: Path, trainable: set[str], zero_var: set[str], steps: int
) -> Ledger:
    """Exactly once, after crashes and restarts: steps 1..`steps` each logged once, every
    trainable key trained once and none lost, the zero-variance keys filtered. The ledger."""
    log = trained_log(run_dir)
    assert [line["step"] for line in log] == list(range(1, steps + 1))  # every step once
    all_keys = [k for line in log for k in line["keys"]]
    assert len(all_keys) == len(set(all_keys)), "a trajectory was trained twice"
    assert set(all_keys) == trainable, "a trajectory was lost"
    ledger = Ledger(r, keys)
    assert {ledger.state_of(k) for k in trainable} == {"trained"}
    assert {ledger.state_of(k) for k in zero_var} == {"filtered:zero_variance"}
    return ledger


def prepared_run(
    tmp_path, r, redis_url, run_name, model_path, **trainer
) -> tuple[Keys, set[str], set[str], Path]:
    """The e2e dataset published to the trainer's group and a run file for it:
    (keys, trainable keys, zero-variance keys, config path)."""
    from transformers import AutoModelForCausalLM

    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainable, zero_var = publish_dataset(r, keys, AutoModelForCausalLM.from_pretrained(model_path))
    return keys, trainable, zero_var, write_config(tmp_path, redis_url, run_name, model_path, **trainer)


def publish_dataset(r, keys: Keys, model) -> tuple[set[str], set[str]]:
    """9 trainable groups of 4 (multi-turn), 1 zero-variance group, a val attempt, a failed
    attempt, one out-of-vocab trajectory and one corrupt entry. Returns (trainable, zero-var) keys."""
    trainable, zero_var = set(), set()
    messages = []
    seed = 0
    for g in range(10):
        for i in range(4):
            reward = 1.0 if g == 9 else float((i + g) % 2)
            t = sampled_trajectory(model, f"g{g}", i, reward, seed=seed, turns=1 + (i % 3))
            seed += 1
            t = Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": keys.run})
            messages.append(t)
            (zero_var if g == 9 else trainable).add(t.key)
    val = sampled_trajectory(model, "v0", 0, 1.0, seed=999)
    messages.append(
        Trajectory(**{**{f: getattr(val, f) for f in val.__struct_fields__}, "run": keys.run, "mode": "val"})
    )
    bad = Turn(model="policy", prompt_ids=pack_tokens([1, 2]), response_ids=pack_tokens([VOCAB + 5]),
               response_logprobs=pack_logprobs([-0.1]), version=0)  # fmt: skip
    messages.insert(7, Trajectory(run=keys.run, task_id="oov:0", group_id="oov", sample_id="oov", index=0,
                                  group_size=1, attempt=0, runner_id="r", status="ok", reward=1.0, turns=[bad]))  # fmt: skip
    bus.publish_many(r, keys.trajectories, messages[:20])
    r.xadd(keys.trajectories, {b"m": b"\xc1not msgpack at all"})
    bus.publish_many(r, keys.trajectories, messages[20:])
    bus.publish_many(r, keys.trajectories, [messages[3], messages[30]])  # re-published copies
    return trainable, zero_var


@pytest.mark.parametrize("backend", ["torch", pytest.param("verl", marks=pytest.mark.verl)])
def test_kill9_resume_trains_every_key_exactly_once(tmp_path, r, redis_url, run_name, backend):
    if backend == "verl":
        need_verl()
    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    keys, trainable, zero_var, config = prepared_run(tmp_path, r, redis_url, run_name, model_path)
    run_dir = tmp_path / "run"

    kills = 0
    for kill_after in (2, 5):  # two crashes at different points of the run
        proc = start_trainer(config, "--max-steps", "9", "--backend", backend)
        try:
            wait_for(
                lambda k=kill_after, p=proc: len(trained_log(run_dir)) >= k or p.poll() is not None,
                120,
                f"step {kill_after}",
            )
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
        finally:
            reap(proc)
    proc = start_trainer(config, "--max-steps", "9", "--backend", backend)
    try:
        rc = proc.wait(180)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-3000:]
    assert kills == 2

    ledger = assert_trained_once(r, keys, run_dir, trainable, zero_var, steps=9)
    assert ledger.state_of("oov:0#0") == "deadlettered" and ledger.balanced()
    reasons = [fields[b"reason"].decode() for _, fields in r.xrange(keys.deadletter)]
    assert (
        len(reasons) == 2 and any("vocab size" in x for x in reasons) and any("msgpack" in x for x in reasons)
    )
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0  # all acked
    assert int(r.hget(keys.versions, "trainer")) == 9
    assert (run_dir / "weights" / "v000009" / "model.safetensors.index.json").exists()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # metrics are written after the commit: a kill in between may lose that step's line
    assert (
        {m["step"] for m in metrics} <= set(range(1, 10)) and len(metrics) >= 7 and metrics[-1]["step"] == 9
    )
    last = metrics[-1]
    for name in ("loss", "kl", "clip_fraction", "entropy", "grad_norm", "reward_mean", "advantage_std",
                 "tokens_per_s", "time/wait_s", "time/train_s", "time/publish_s"):  # fmt: skip
        assert name in last
    assert r.xlen(keys.metrics) == len(metrics)


def test_sigterm_finishes_step_and_exits_zero(tmp_path, r, redis_url, run_name):
    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    keys, trainable, _, config = prepared_run(tmp_path, r, redis_url, run_name, model_path)
    run_dir = tmp_path / "run"
    proc = start_trainer(config)
    try:
        wait_for(lambda: len(trained_log(run_dir)) >= 1 or proc.poll() is not None, 120, "first step")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-3000:]
    log = trained_log(run_dir)
    done = {k for line in log for k in line["keys"]}
    assert done <= trainable and done
    pending = r.xpending(keys.trajectories, GROUP_TRAINER)["pending"]
    # nothing trained is left unacked; what is pending was never trained
    if pending:
        rows = r.xpending_range(keys.trajectories, GROUP_TRAINER, min="-", max="+", count=1000)
        ids = {row["message_id"] for row in rows}
        trained_ids = set()
        for entry_id, fields in r.xrange(keys.trajectories):
            try:
                from squall.shared.schemas import decode

                if decode(fields[b"m"]).key in done:
                    trained_ids.add(entry_id)
            except Exception:
                continue
        assert not ids & trained_ids

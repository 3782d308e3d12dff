"""Several trained roles in one trainer (services/trainer/multirole.py) on a real Redis and a
tiny model: every trained token reaches exactly its own role's batch, with its own role's
reward; each role publishes its own adapter and version; the ledger balances; a kill -9
between two roles' steps resumes training nothing twice and losing nothing, per role."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from test_trainer_step import make_tiny_model, sampled_trajectory

from squall.shared import bus, dataend
from squall.shared.adapterfiles import ADAPTER_WEIGHTS
from squall.shared.config import load_config
from squall.shared.keys import Keys, trainer_group
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, WeightVersion, decode
from squall.trainer.multirole import RoleLoop, build_trainers
from squall.trainer.sequences import trajectory_to_samples

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SEATS = {"wolves": "wolf", "villagers": "vil"}  # role -> its one seat in these games
TINY_TARGETS = ["q_proj", "v_proj"]


def roles_config(tmp_path: Path, model_path: Path, run_name: str, redis_url: str):
    return load_config(
        overrides={
            "run": {"name": run_name, "dir": str(tmp_path / "run"), "redis_url": redis_url},
            "model": {"path": str(model_path)},
            "trainer": {"lr": 1e-2, "device": "cpu", "groups_per_step": 1},
            "roles": {
                "wolves": {"agents": ["wolf"], "lora": {"rank": 4, "alpha": 8, "targets": TINY_TARGETS}},
                "villagers": {
                    "agents": ["vil"],
                    "lr": 5e-3,
                    "lora": {"rank": 2, "alpha": 4, "targets": TINY_TARGETS},
                },
            },
        },
        env={},
    )


def two_seat_game(model, run: str, group: str, index: int) -> Trajectory:
    """One attempt where the wolf speaks first and the villager second; the villagers win the
    odd games (reward 1 for them, 0 for the wolves)."""
    base = sampled_trajectory(model, group, index, 0.5, seed=100 * index + len(group), turns=2)
    wolf, vil = base.turns
    turns = [
        msgspec.structs.replace(wolf, agent="wolf", role="wolves", model="wolves"),
        msgspec.structs.replace(vil, agent="vil", role="villagers", model="villagers"),
    ]
    won = float(index % 2)
    return msgspec.structs.replace(
        base, run=run, turns=turns, role_rewards={"villagers": won, "wolves": 1.0 - won}
    )


def trained_tokens(sample) -> list[int]:
    return [int(t) for t in sample.input_ids[sample.loss_mask > 0]]


def record_batches(trainers) -> dict[str, list]:
    """Each role's backend keeps the samples of every step it takes (the real step still runs)."""
    seen: dict[str, list] = {t.role: [] for t in trainers}
    for trainer in trainers:
        step = trainer.backend.train_step

        def recording(samples, step=step, role=trainer.role):
            seen[role].extend(samples)
            return step(samples)

        trainer.backend.train_step = recording  # type: ignore[method-assign]
    return seen


def test_two_roles_each_token_reaches_its_own_roles_batch(tmp_path, r, redis_url, run_name):
    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    config = roles_config(tmp_path, model_path, run_name, redis_url)
    keys = Keys(run_name)
    trainers = build_trainers(config)
    wolves, villagers = trainers
    assert wolves.backend.model is villagers.backend.model  # one base, two adapters
    base_before = {
        n: p.detach().clone() for n, p in wolves.backend.model.named_parameters() if "lora_" not in n
    }
    seen = record_batches(trainers)
    with torch.no_grad(), wolves.backend.model.disable_adapter():
        games = [two_seat_game(wolves.backend.model, run_name, "a", i) for i in range(4)]
    bus.publish_many(r, keys.trajectories, games)
    Ledger(r, keys).move([g.key for g in games], "ok")

    loop = RoleLoop(trainers)
    stopper = threading.Thread(
        target=lambda: _stop_when(loop, lambda: all(t.state.step >= 1 for t in trainers))
    )
    stopper.start()
    assert loop.run() == 0
    stopper.join()

    by_key = {g.key: g for g in games}
    for role, seat_turn in (("wolves", 0), ("villagers", 1)):
        batch = seen[role]
        assert sorted(s.key for s in batch) == sorted(by_key)  # one sample per game, every game
        for sample in batch:
            game = by_key[sample.key]
            assert trained_tokens(sample) == game.turns[seat_turn].response_tokens.tolist()
            won = game.role_rewards[role]
            assert np.sign(sample.advantage) == (1.0 if won else -1.0)  # the role's own reward
    # The other seat's tokens never reach a role's batch: the two roles' trained token sets differ.
    assert {tuple(trained_tokens(s)) for s in seen["wolves"]}.isdisjoint(
        {tuple(trained_tokens(s)) for s in seen["villagers"]}
    )

    versions = [decode(f[b"m"], WeightVersion) for _, f in r.xrange(keys.weights)]
    assert sorted((v.role, v.version) for v in versions) == [
        ("villagers", 0), ("villagers", 1), ("wolves", 0), ("wolves", 1)
    ]  # fmt: skip
    assert int(r.hget(keys.versions, "trainer:wolves")) == 1
    assert int(r.hget(keys.versions, "trainer:villagers")) == 1
    assert r.hget(keys.versions, "trainer") is None  # no `policy` role in this run
    from safetensors.torch import load_file

    published = {
        role: load_file(str(tmp_path / "run" / "roles" / role / "weights" / "v000001" / ADAPTER_WEIGHTS))
        for role in SEATS
    }
    ranks = {role: {t.shape for n, t in w.items() if "lora_A" in n} for role, w in published.items()}
    assert ranks == {"wolves": {torch.Size([4, 32])}, "villagers": {torch.Size([2, 32])}}
    assert all(".wolves." not in n and ".villagers." not in n for w in published.values() for n in w)
    base_after = {n: p for n, p in wolves.backend.model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)  # the base never trains

    ledger = Ledger(r, keys)
    assert {ledger.state_of(g.key) for g in games} == {"trained"} and ledger.balanced()
    for role in SEATS:
        assert r.xpending(keys.trajectories, trainer_group(role))["pending"] == 0
    metrics = [decode(f[b"m"]) for _, f in r.xrange(keys.metrics)]
    assert sorted(m.role for m in metrics) == ["villagers", "wolves"]

    from prometheus_client import REGISTRY

    for role in SEATS:  # /metrics: one series per role
        assert REGISTRY.get_sample_value("squall_role_step", {"role": role}) == 1.0
        assert REGISTRY.get_sample_value("squall_weight_version", {"role": f"trainer:{role}"}) == 1.0
        assert (
            REGISTRY.get_sample_value("squall_role_staleness_total", {"role": role, "versions_behind": "0"})
            == 4.0
        )

    from squall.monitor.status import collect, render

    status = collect(r, run_name)  # `squall status`: one line per role
    assert {name: role["version"] for name, role in status["roles"].items()} == {"villagers": 1, "wolves": 1}
    assert status["role_steps"]["wolves"]["trajectories"] == 4.0
    lines = [line for line in render(status).splitlines() if line.startswith("role ")]
    assert len(lines) == 2 and all(
        "version=1" in line and "lag=0 pending=0 step=1" in line for line in lines
    ), lines


def _stop_when(loop: RoleLoop, done, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    loop.request_stop()


CRASH_BETWEEN_ROLES = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    from squall.shared.config import load_config
    from squall.trainer.multirole import build_trainers

    torch.set_num_threads(1)
    config = load_config(overrides=json.loads(sys.argv[1]), env={})
    wolves, villagers = build_trainers(config)
    for trainer in (wolves, villagers):
        trainer._recover(announce=True)
    while wolves.state.step < 1:
        wolves._work_once()
    villagers._handle(villagers.consumer.read(256))  # read into its open group, not stepped yet
    os.kill(os.getpid(), signal.SIGKILL)  # the wolves' step is durable, the villagers' never ran
    """
)


def test_kill_9_between_two_roles_steps_trains_nothing_twice_and_loses_nothing(
    tmp_path, r, redis_url, run_name
):
    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    config = roles_config(tmp_path, model_path, run_name, redis_url)
    keys = Keys(run_name)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    games = [two_seat_game(model, run_name, "a", i) for i in range(4)]
    for role in SEATS:  # the groups exist before the games are written, as `squall up` makes them
        bus.ensure_group(r, keys.trajectories, trainer_group(role))
    bus.publish_many(r, keys.trajectories, games)
    Ledger(r, keys).move([g.key for g in games], "ok")

    overrides = json.loads(config.model_dump_json(include={"run", "model", "trainer", "roles"}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    child = subprocess.run(
        [sys.executable, "-c", CRASH_BETWEEN_ROLES, json.dumps(overrides)],
        env=env,
        capture_output=True,
        timeout=180,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert r.xpending(keys.trajectories, trainer_group("wolves"))["pending"] == 0  # settled before the kill
    assert r.xpending(keys.trajectories, trainer_group("villagers"))["pending"] == 4  # read, never trained

    trainers = build_trainers(config)
    wolves, villagers = trainers
    assert (wolves.state.step, villagers.state.step) == (1, 0)
    seen = record_batches(trainers)
    dataend.announce_data_end(r, keys, len(games))  # and the data ran out: each role answers on its own
    loop = RoleLoop(trainers)
    stopper = threading.Thread(
        target=lambda: _stop_when(loop, lambda: dataend.read(r, keys).trainer_version is not None)
    )
    stopper.start()
    assert loop.run() == 0
    stopper.join()

    assert seen["wolves"] == []  # nothing trained twice
    assert sorted(s.key for s in seen["villagers"]) == sorted(g.key for g in games)  # nothing lost
    assert (wolves.state.step, villagers.state.step) == (1, 1)
    for role in SEATS:
        log = tmp_path / "run" / "roles" / role / "trained.jsonl"
        lines = [json.loads(x) for x in log.read_text().splitlines()]
        assert [(x["step"], sorted(x["keys"])) for x in lines] == [(1, sorted(g.key for g in games))], role
        assert r.xpending(keys.trajectories, trainer_group(role))["pending"] == 0
        assert int(r.hget(keys.versions, f"trainer:{role}")) == 1
    ledger = Ledger(r, keys)
    assert {ledger.state_of(g.key) for g in games} == {"trained"} and ledger.balanced()
    answers = {
        k.decode(): int(v) for k, v in r.hgetall(keys.data_end).items() if k.startswith(b"trainer_version")
    }
    assert answers == {"trainer_version:wolves": 1, "trainer_version:villagers": 1, "trainer_version": 1}


def test_activation_checkpointing_on_the_shared_base_trains_each_roles_adapter(tmp_path, run_name, redis_url):
    """`trainer.gradient_checkpointing` in a roles run: the base recomputes activations (through
    transformers' current name for it, not the alias v6 removes) and a step still reaches the
    active role's adapter, and only it, through the checkpointed layers."""
    import warnings

    torch.set_num_threads(1)
    config = roles_config(tmp_path, make_tiny_model(tmp_path / "model"), run_name, redis_url)
    config = config.model_copy(
        update={"trainer": config.trainer.model_copy(update={"gradient_checkpointing": True})}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wolves, villagers = build_trainers(config)
    assert not [w for w in caught if "gradient_checkpointing_enable" in str(w.message)]
    base = wolves.backend.model.get_base_model()
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing

    def adapter(role: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in base.named_parameters() if f".{role}." in n}

    before = {role: adapter(role) for role in SEATS}
    model = wolves.backend.model
    samples = []
    for i in range(4):
        t = sampled_trajectory(model, "g", i, float(i % 2), seed=i)
        samples += trajectory_to_samples(t, advantage=1.0 if i % 2 else -1.0)
    metrics = wolves.backend.train_step(samples)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = {role: adapter(role) for role in SEATS}
    assert any(not torch.equal(before["wolves"][n], after["wolves"][n]) for n in before["wolves"])
    assert all(torch.equal(before["villagers"][n], after["villagers"][n]) for n in before["villagers"])

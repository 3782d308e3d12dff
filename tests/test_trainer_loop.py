"""The trainer loop in-process on a real Redis and a tiny model: a group completed by its
deadline, a late member, a validation attempt, a stale group, weight versions 0 and 1."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_trainer_step import config_for, make_tiny_model, sampled_trajectory

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, WeightVersion, decode
from squall.trainer.trainer import Trainer

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def retag(t: Trajectory, run: str, **changes) -> Trajectory:
    return Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": run, **changes})


def run_config(tmp_path, run_name: str, redis_url: str, **trainer):
    """A fresh tiny model and a run on the test's Redis: (config, keys); one torch thread."""
    torch.set_num_threads(1)
    config = config_for(tmp_path, make_tiny_model(tmp_path / "model"), **trainer)
    run = config.run.model_copy(update={"name": run_name, "redis_url": redis_url})
    return config.model_copy(update={"run": run}), Keys(run_name)


def run_until_step(trainer: Trainer, steps: int, timeout_s: float = 60.0) -> None:
    """Run `trainer` in this thread until it has made `steps` optimizer steps (or `timeout_s`
    passed), then stop it; asserts it exits 0."""

    def stop_when_done() -> None:
        deadline = time.monotonic() + timeout_s
        while trainer.state.step < steps and time.monotonic() < deadline:
            time.sleep(0.05)
        trainer.request_stop()

    helper = threading.Thread(target=stop_when_done)
    helper.start()
    assert trainer.run() == 0
    helper.join()


def test_deadline_late_val_and_stale(tmp_path, r, redis_url, run_name):
    config, keys = run_config(
        tmp_path, run_name, redis_url, groups_per_step=1, group_wait_s=1.0, max_sample_age=0
    )
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    model = trainer.backend.model
    partial = [retag(sampled_trajectory(model, "a", i, float(i % 2), seed=i), run_name) for i in range(3)]
    missing = retag(sampled_trajectory(model, "a", 3, 1.0, seed=3), run_name)
    val = retag(sampled_trajectory(model, "v", 0, 1.0, seed=9), run_name, mode="val")
    stale = [retag(sampled_trajectory(model, "s", i, float(i % 2), seed=20 + i), run_name) for i in range(4)]
    bus.publish_many(r, keys.trajectories, [*partial, val])

    def later():
        deadline = time.monotonic() + 60
        while trainer.state.step < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        bus.publish_many(r, keys.trajectories, [missing, *stale])  # version-0 turns, trainer now at 1
        while len(trainer.books.pending.consumed) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        trainer.request_stop()

    helper = threading.Thread(target=later)
    helper.start()
    assert trainer.run() == 0
    helper.join()

    ledger = Ledger(r, keys)
    assert [ledger.state_of(t.key) for t in partial] == ["trained"] * 3  # trained without the 4th
    assert ledger.state_of(missing.key) == "late"
    assert {ledger.state_of(t.key) for t in stale} == {"filtered:stale"}
    assert ledger.state_of(val.key) is None  # the scheduler records validation, not the trainer
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    assert trainer.state.step == 1 and trainer.state.version == 1
    versions = [decode(f[b"m"], WeightVersion).version for _, f in r.xrange(keys.weights)]
    assert versions == [0, 1]
    metrics = [decode(f[b"m"]) for _, f in r.xrange(keys.metrics)]
    assert len(metrics) == 1 and metrics[0].values["groups_timed_out"] == 1.0
    assert metrics[0].values["trajectories"] == 3.0
    assert int(r.hget(keys.versions, "trainer")) == 1
    assert r.hexists(keys.heartbeats, "trainer:trainer")


def test_resume_after_crash_between_checkpoint_and_acks(tmp_path, r, redis_url, run_name):
    """The checkpoint of step 1 is durable but the process died before its ledger moves, acks,
    log line and weight announcement: a restart finishes all four and trains nothing again."""
    import json

    from squall.trainer.backend import make_backend
    from squall.trainer.checkpoint import CheckpointStore, TrainerState

    config, keys = run_config(tmp_path, run_name, redis_url, groups_per_step=1)
    backend = make_backend("torch", config)
    group = [
        retag(sampled_trajectory(backend.model, "a", i, float(i % 2), seed=i), run_name) for i in range(4)
    ]
    bus.publish_many(r, keys.trajectories, group)
    reader = bus.GroupConsumer(r, keys.trajectories, GROUP_TRAINER, "trainer", kind=Trajectory,
                               deadletter_stream=keys.deadletter)  # fmt: skip
    assert len(reader.read(10)) == 4  # delivered to "trainer", never acked
    ledger = Ledger(r, keys)
    ledger.move([t.key for t in group], "ok")
    state = TrainerState(commit=1, step=1, version=1, trained={t.key: 1 for t in group}, done_groups=["a"])
    CheckpointStore(tmp_path / "run" / "checkpoints").save(state, backend.save_state)

    trainer = Trainer(config)
    stopper = threading.Timer(3.0, trainer.request_stop)
    stopper.start()
    assert trainer.run() == 0
    stopper.join()
    assert {ledger.state_of(t.key) for t in group} == {"trained"} and ledger.balanced()
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    assert trainer.state.step == 1  # nothing trained twice
    log = [json.loads(x) for x in (tmp_path / "run" / "trained.jsonl").read_text().splitlines()]
    assert [(x["step"], sorted(x["keys"])) for x in log] == [(1, sorted(t.key for t in group))]
    assert int(r.hget(keys.versions, "trainer")) == 1
    assert (tmp_path / "run" / "weights" / "v000001" / "model.safetensors.index.json").exists()


def test_a_steps_group_counts_as_trained_only_after_its_version_is_announced(
    tmp_path, r, redis_url, run_name
):
    """The scheduler dispatches the next group when the ledger says a held one was trained, at
    the trainer's announced version: when the new version is announced the step's group must
    not yet count as trained (else the next group goes out on the old version), and after
    the step it must."""
    config, keys = run_config(tmp_path, run_name, redis_url, groups_per_step=1)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    group = [
        retag(sampled_trajectory(trainer.backend.model, "a", i, float(i % 2), seed=i), run_name)
        for i in range(4)
    ]
    ledger = Ledger(r, keys)
    ledger.move([t.key for t in group], "ok")  # as the scheduler leaves finished attempts
    bus.publish_many(r, keys.trajectories, group)
    seen: list[tuple[int, int, set]] = []
    publish = trainer.publisher.publish

    def publish_and_look(version: int, step: int, state: dict) -> WeightVersion:
        message = publish(version, step, state)
        announced = int(r.hget(keys.versions, "trainer"))
        seen.append((version, announced, {ledger.state_of(t.key) for t in group}))
        return message

    trainer.publisher.publish = publish_and_look  # type: ignore[method-assign]
    run_until_step(trainer, 1)
    assert seen == [(0, 0, {"ok"}), (1, 1, {"ok"})]  # announced while the group is still "ok"
    assert {ledger.state_of(t.key) for t in group} == {"trained"} and ledger.balanced()
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0

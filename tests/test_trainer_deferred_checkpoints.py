"""Checkpoints every k steps (trainer.checkpoint_every) with acknowledgements deferred to the
checkpoint that holds their effect: a real trainer process on a real Redis and a tiny real
model is killed with SIGKILL while two steps are trained, published and not checkpointed; the
restart re-trains them from the last checkpoint, every key is trained exactly once in the final
weights' history and none is lost, and no version number names two sets of weights."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from test_trainer_e2e import start_trainer, trained_log, write_config
from test_trainer_step import make_tiny_model, sampled_trajectory
from waiting import reap, wait_for

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory
from squall.trainer.bookkeeping import Bookkeeping, Seen
from squall.trainer.cadence import CheckpointCadence, resume_version
from squall.trainer.checkpoint import TrainerState


def groups(model, run: str, first: int, count: int) -> list[Trajectory]:
    """`count` trainable groups of 4 (rewards 0/1), numbered from `first`."""
    out = []
    for g in range(first, first + count):
        for i in range(4):
            t = sampled_trajectory(model, f"g{g}", i, float((i + g) % 2), seed=g * 4 + i)
            out.append(Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": run}))
    return out


@pytest.mark.redis
@pytest.mark.slow
def test_kill9_between_checkpoints_retrains_from_the_last_one(tmp_path, r, redis_url, run_name):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    run_dir = tmp_path / "run"
    # idle checkpoints off for this test: the kill must fall between two cadence checkpoints
    config = write_config(
        tmp_path, redis_url, run_name, model_path, checkpoint_every=3, checkpoint_idle_s=3600.0
    )
    first, rest = groups(model, keys.run, 0, 5), groups(model, keys.run, 5, 4)
    bus.publish_many(r, keys.trajectories, first)  # 5 steps' worth: a checkpoint at 3, 4 and 5 deferred

    proc = start_trainer(config, "--max-steps", "9")
    try:
        wait_for(
            lambda: int(r.hget(keys.versions, "trainer") or 0) >= 5 or proc.poll() is not None,
            120,
            "version 5",
        )
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        # steps 4 and 5 are trained and published, not checkpointed: their 8 entries wait unacked
        assert [line["step"] for line in trained_log(run_dir)] == [1, 2, 3]
        assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 8
        assert {Ledger(r, keys).state_of(t.key) for t in first[12:]} != {"trained"}
        proc.kill()
        proc.wait(10)
    finally:
        reap(proc)

    bus.publish_many(r, keys.trajectories, rest)
    proc = start_trainer(config, "--max-steps", "9")
    try:
        rc = proc.wait(180)
    finally:
        reap(proc)
    assert rc == 0, proc.stderr.read().decode()[-3000:]

    log = trained_log(run_dir)
    assert [line["step"] for line in log] == list(range(1, 10))  # each step once in the final history
    trained = [k for line in log for k in line["keys"]]
    assert Counter(trained).most_common(1)[0][1] == 1, "a trajectory was trained twice"
    assert set(trained) == {t.key for t in first + rest}, "a trajectory was lost"
    ledger = Ledger(r, keys)
    assert {ledger.state_of(t.key) for t in first + rest} == {"trained"} and ledger.balanced()
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    # checkpoints at steps 3, 6, 9 (and none per step): the done log has one line per commit
    commits = [json.loads(x) for x in (run_dir / "checkpoints" / "done.jsonl").read_text().splitlines()]
    assert [c["commit"] for c in commits] == [1, 2, 3]
    # versions 4 and 5 were served from the lost steps: the restart restored step 3's weights as
    # version 6, and steps 4..9 became versions 7..12
    assert int(r.hget(keys.versions, "trainer")) == 12
    assert [line["version"] for line in log] == [1, 2, 3, 7, 8, 9, 10, 11, 12]


def test_cadence_counts_steps_seconds_and_quiet_reads():
    now = [0.0]
    cadence = CheckpointCadence(every_steps=3, every_s=0.0, idle_s=10.0, clock=lambda: now[0])
    cadence.stepped()
    cadence.stepped()
    assert not cadence.due_after_step()
    cadence.read(False)
    now[0] = 9.0
    assert not cadence.due_when_quiet()  # quiet for 9 s of 10, two steps deferred
    cadence.read(True)  # an entry arrived: the quiet spell starts again
    cadence.read(False)
    now[0] = 18.0
    assert not cadence.due_when_quiet()
    now[0] = 19.5
    assert cadence.due_when_quiet()
    cadence.stepped()
    assert cadence.due_after_step()
    cadence.checkpointed()
    assert cadence.due_when_quiet()  # nothing deferred: filtered work commits on the first quiet read
    timed = CheckpointCadence(every_steps=100, every_s=60.0, clock=lambda: now[0])
    timed.stepped()
    now[0] += 59.0
    assert not timed.due_after_step()
    now[0] += 1.0
    assert timed.due_after_step()


def test_resume_version_moves_past_versions_lost_with_their_steps():
    state = TrainerState(commit=1, step=3, version=3, version_step=3)
    assert not resume_version(state, None) and not resume_version(state, 3) and not resume_version(state, 2)
    assert resume_version(state, 5)
    assert (state.version, state.version_step, state.step) == (6, 3, 3)


def test_a_commit_spans_several_steps_and_a_second_copy_of_a_trained_key_is_in_flight():
    books = Bookkeeping(TrainerState(), group_wait_s=60.0, max_attempts=3)
    books.entry_ids = {"k1": "1-0", "k2": "2-0"}
    books.train("k1")
    books.stepped(1, version=1)
    assert books.seen("k1") is Seen.IN_FLIGHT  # trained, not durable: a copy must not train again
    books.train("k2")
    books.stepped(2, version=2)
    sealed = books.seal(step=2)
    assert sealed.done.trained == {"k1": 1, "k2": 2}
    assert sealed.steps == [(1, 1, ["k1"]), (2, 2, ["k2"])] and sorted(sealed.entry_ids) == ["1-0", "2-0"]
    assert books.seen("k1") is Seen.DONE and books.seen("k3") is Seen.NEW

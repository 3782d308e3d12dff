"""The trainer's exactly-once bookkeeping and its durable done set, without Redis or a model:
where each entry is (open, waiting, next commit, durable), the ledger moves a commit makes,
and a checkpoint that writes only its own commit's keys while resume sees them all."""

from __future__ import annotations

import json

import pytest
from test_trainer_algos import traj, turn

from squall.trainer.bookkeeping import Bookkeeping, Seen, ledger_moves
from squall.trainer.checkpoint import CheckpointStore, DoneDelta, TrainerState
from squall.trainer.filters import decide_group


def member(group, index, reward, *, version=0, status="ok"):
    return traj(group, index, reward, [turn([1, 2], [3, 4], version=version)], status=status, size=2)


def decide(group):
    return decide_group(group.group_id, [m.trajectory for m in group.members], trainer_version=0,
                        max_staleness=0, overlong="mask", max_seq_len=64)  # fmt: skip


def books(state=None):
    return Bookkeeping(state or TrainerState(), group_wait_s=60.0, max_attempts=1)


def test_an_entry_goes_open_waiting_next_durable():
    b = books()
    a, c = member("g", 0, 1.0), member("g", 1, 0.0)
    assert b.add("1-0", a) == "added" and b.seen(a.key) is Seen.NEW  # open: the assembler has it
    assert b.add("1-1", a) == "duplicate"
    b.add("2-0", c)
    b.collect(decide)
    assert b.seen(a.key) is Seen.IN_FLIGHT and len(b.ready) == 1  # waiting for a step
    assert b.take_ready(2) == [] and len(b.ready) == 1
    (decision,) = b.take_ready(1)
    b.train(a.key)
    b.drop(c.key, "no_trained_tokens")
    b.close(decision)
    assert b.uncommitted() and b.pending.trained == [a.key]
    sealed = b.seal(step=1)
    assert sealed.done == DoneDelta({a.key: 1}, {c.key: "no_trained_tokens"}, ["g"])
    assert sorted(sealed.entry_ids) == ["1-0", "2-0"]
    assert sealed.counts == {"filtered:no_trained_tokens": 1}
    assert b.seen(a.key) is Seen.DONE and b.seen(c.key) is Seen.DONE and not b.uncommitted()
    assert b.add("3-0", member("g", 0, 1.0, status="failed")) == "late"  # group closed
    assert b.pending.consumed == {"g:0#0": "late"} and b.pending.counts == {"late": 1}


def test_filtered_groups_join_the_next_commit_whole():
    b = books()
    for i in range(2):
        b.add(f"{i}-0", member("z", i, 1.0))  # equal rewards: zero variance
    b.add("9-0", member("s", 0, 1.0, version=-5))
    b.collect(decide)
    assert b.ready == [] and set(b.pending.consumed.values()) == {"zero_variance"}
    assert b.pending.groups == ["z"] and b.pending.counts == {"filtered:zero_variance": 2}
    assert list(b.assembler.open) == ["s"]  # still assembling


def test_reset_keeps_only_what_is_durable():
    b = books()
    b.add("1-0", member("g", 0, 1.0))
    b.add("1-1", member("g", 1, 0.0))
    b.collect(decide)
    b.reset()  # e.g. after a Redis outage: the entries are read again from the pending list
    assert b.ready == [] and not b.uncommitted() and b.assembler.open == {}
    assert b.add("1-0", member("g", 0, 1.0)) == "added"  # not late: "g" never became durable


def test_ledger_moves_map_each_reason_once():
    done = DoneDelta(
        trained={"a#0": 3},
        consumed={"b#0": "late", "c#0": "stale", "d#0": "stale", "e#0": "failed", "f#0": "timeout"},
    )
    moves = ledger_moves(done)
    assert moves == [("train", None, ["a#0"]), ("late", None, ["b#0"]), ("filter", "stale", ["c#0", "d#0"])]
    b = books(TrainerState(trained={"a#0": 3}, consumed={"b#0": "late", "e#0": "failed"}))
    assert b.covered(["a#0", "b#0", "e#0", "zz#0"]) == DoneDelta({"a#0": 3}, {"b#0": "late", "e#0": "failed"})


def save(store, state, delta):
    state.commit += 1
    state.add(delta)
    return store.save(state, lambda path: path.write_bytes(b"model"), delta)


def test_a_checkpoint_holds_its_own_commit_and_resume_sees_every_commit(tmp_path):
    store, state = CheckpointStore(tmp_path), TrainerState()
    for i in range(5):
        state.step = i + 1
        save(store, state, DoneDelta({f"t{i}#0": i + 1}, {f"f{i}#0": "stale"}, [f"g{i}"]))
    meta = json.loads((store.list()[-1] / "meta.json").read_text())
    assert meta["trained"] == {"t4#0": 5} and meta["done_groups"] == ["g4"]  # not the whole set
    loaded, _ = CheckpointStore(tmp_path).latest()
    assert loaded == state and len(loaded.trained) == 5 and loaded.is_done("f0#0")


def test_the_done_log_follows_the_checkpoints_after_a_crash(tmp_path):
    store, state = CheckpointStore(tmp_path), TrainerState()
    save(store, state, DoneDelta({"a#0": 1}, {}, ["a"]))
    path = save(store, state, DoneDelta({"b#0": 2}, {}, ["b"]))
    log = tmp_path / "done.jsonl"
    lines = log.read_bytes().splitlines()
    # A crash between the rename of commit 2 and its log line: the line is restored from meta.
    log.write_bytes(lines[0] + b"\n")
    loaded, _ = CheckpointStore(tmp_path).latest()
    assert set(loaded.trained) == {"a#0", "b#0"}
    assert [json.loads(x)["commit"] for x in log.read_bytes().splitlines()] == [1, 2]
    # A newest checkpoint that is unreadable: resume from commit 1, and forget commit 2's line.
    (path / "meta.json").write_text("{torn")
    loaded, _ = CheckpointStore(tmp_path).latest()
    assert loaded.commit == 1 and set(loaded.trained) == {"a#0"}
    assert [json.loads(x)["commit"] for x in log.read_bytes().splitlines()] == [1]


@pytest.mark.parametrize("torn", [b'{"commit": 3, "tra', b""])
def test_a_torn_last_line_is_ignored(tmp_path, torn):
    store, state = CheckpointStore(tmp_path), TrainerState()
    save(store, state, DoneDelta({"a#0": 1}))
    save(store, state, DoneDelta({"b#0": 2}))
    with open(tmp_path / "done.jsonl", "ab") as handle:
        handle.write(torn)
    loaded, _ = CheckpointStore(tmp_path).latest()
    assert loaded.commit == 2 and set(loaded.trained) == {"a#0", "b#0"}

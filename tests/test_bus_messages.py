"""Wire messages: every kind round-trips; every kind of malformed entry is rejected clearly."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from squall.shared import bus, schemas
from squall.shared.errors import SchemaError
from squall.shared.keys import GROUP_RUNNERS, Keys


def make_turn(n_prompt: int = 5, n_response: int = 3, **overrides) -> schemas.Turn:
    rng = np.random.default_rng(n_prompt)
    fields = dict(
        model="policy",
        prompt_ids=schemas.pack_tokens(rng.integers(0, 500, n_prompt)),
        response_ids=schemas.pack_tokens(rng.integers(0, 500, n_response)),
        response_logprobs=schemas.pack_logprobs(-rng.random(n_response)),
        version=3,
    )
    fields.update(overrides)
    return schemas.Turn(**fields)


def make_trajectory(**overrides) -> schemas.Trajectory:
    fields = dict(
        run="r",
        task_id="g1:0",
        group_id="g1",
        sample_id="s1",
        index=0,
        group_size=4,
        attempt=1,
        runner_id="runner-1/0",
        status="ok",
        reward=0.5,
        turns=[make_turn(), make_turn(8, 2)],
    )
    fields.update(overrides)
    return schemas.Trajectory(**fields)


def make_task(**overrides) -> schemas.Task:
    fields = dict(
        run="r",
        task_id="g1:0",
        group_id="g1",
        sample_id="s1",
        index=0,
        group_size=4,
        payload={"question": "1+1", "answer": 2},
        deadline=1e10,
    )
    fields.update(overrides)
    return schemas.Task(**fields)


EVERY_MESSAGE = [
    make_task(),
    make_trajectory(),
    make_trajectory(status="failed", reward=None, error="boom", turns=[]),
    schemas.WeightVersion(run="r", version=2, step=2, location="/w/v2/model.safetensors", checksum="ab" * 32),
    schemas.WeightApplied(run="r", node="n1", version=2, load_s=0.4),
    schemas.Control(run="r", action="limits", limits={"max_inflight_groups": 4}),
    schemas.Metrics(run="r", step=1, version=1, values={"loss": 0.1}),
    schemas.Event(run="r", service="trainer", name="started", fields={"pid": 1}),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    raw = schemas.encode(message)
    assert schemas.decode(raw) == message
    assert schemas.decode(raw, type(message)) == message


def test_turn_arrays_line_up():
    turn = make_turn(4, 6)
    assert turn.response_tokens.dtype == np.int32 and turn.response_tokens.size == 6
    assert turn.logprobs.size == 6 and np.all(turn.logprobs <= 0)
    shown = schemas.to_jsonable(make_trajectory())
    assert shown["turns"][0]["prompt_ids"] == make_turn().prompt_tokens.tolist()


def _bad_entries() -> dict[str, tuple[bytes, str]]:
    good = msgspec.msgpack.decode(schemas.encode(make_trajectory()))
    wrong_version = dict(good, v=99)
    wrong_type = dict(good, attempt="one")
    missing = {k: v for k, v in good.items() if k != "runner_id"}
    nan_reward = schemas.encode(make_trajectory(reward=math.nan))
    negative = schemas.encode(
        make_trajectory(turns=[make_turn(response_ids=schemas.pack_tokens([5, -3, 1]))])
    )
    mismatched = schemas.encode(
        make_trajectory(turns=[make_turn(response_logprobs=schemas.pack_logprobs([-1.0]))])
    )
    enc = msgspec.msgpack.encode
    return {
        "not msgpack": (b"\xc1\xff garbage", "msgpack"),
        "wrong schema version": (enc(wrong_version), "schema version 99"),
        "wrong type": (enc(wrong_type), "attempt"),
        "missing field": (enc(missing), "runner_id"),
        "NaN reward": (nan_reward, "reward is nan"),
        "negative token id": (negative, "negative token id"),
        "logprobs misaligned": (mismatched, "logprobs"),
    }


@pytest.mark.parametrize("case", list(_bad_entries()))
def test_decode_rejects_malformed(case):
    raw, expected = _bad_entries()[case]
    with pytest.raises(SchemaError, match=expected):
        schemas.decode(raw, schemas.Trajectory)


@pytest.mark.redis
def test_consumer_dead_letters_malformed_and_keeps_going(r, run_name):
    keys = Keys(run_name)
    bad = _bad_entries()
    good = make_trajectory()
    for raw, _ in bad.values():
        r.xadd(keys.trajectories, {schemas.ENTRY_FIELD: raw})
        bus.publish(r, keys.trajectories, good)
    r.xadd(keys.trajectories, {"unexpected": "field"})
    consumer = bus.GroupConsumer(
        r, keys.trajectories, "trainer", "c1", kind=schemas.Trajectory, deadletter_stream=keys.deadletter
    )
    delivered = consumer.read(count=100, block_ms=100)
    assert [d.message for d in delivered] == [good] * len(bad)
    assert consumer.dead_lettered == len(bad) + 1
    records = r.xrange(keys.deadletter)
    reasons = [fields[b"reason"].decode() for _, fields in records]
    for (raw, expected), reason, (_, fields) in zip(
        bad.values(), reasons, records, strict=False
    ):  # records has one more: the fieldless entry
        assert expected in reason
        assert fields[b"raw"] == raw  # the original bytes are kept
        assert fields[b"source"].decode() == keys.trajectories
    # Rejected entries are acked: nothing of them stays pending.
    consumer.ack([d.entry_id for d in delivered])
    assert r.xpending(keys.trajectories, "trainer")["pending"] == 0


@pytest.mark.redis
def test_task_kind_mismatch_is_dead_lettered(r, run_name):
    keys = Keys(run_name)
    bus.publish(r, keys.tasks, make_trajectory())  # a trajectory where tasks are expected
    bus.publish(r, keys.tasks, make_task())
    consumer = bus.GroupConsumer(
        r, keys.tasks, GROUP_RUNNERS, "c", kind=schemas.Task, deadletter_stream=keys.deadletter
    )
    assert [d.message.task_id for d in consumer.read(10, 100)] == ["g1:0"]
    assert r.xlen(keys.deadletter) == 1

"""Helpers for the tracking tests: a run's streams filled as the services fill them (the same
message types, published with shared.bus), and the config of a tracker pointed at it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from squall.shared import bus, schemas
from squall.shared.config import RunConfig, load_config
from squall.shared.keys import Keys

POLICY = Path(__file__).resolve().parents[1] / "examples" / "calc" / "policy"  # committed tiny policy


def tracking_config(
    tmp_path: Path, run: str, redis_url: str, backends: list[str], **tracking: Any
) -> RunConfig:
    section = {"backends": backends, "dir": str(tmp_path / "tracking"), **tracking}
    return load_config(
        env={},
        overrides={
            "run": {"name": run, "redis_url": redis_url, "dir": str(tmp_path / "run")},
            "model": {"path": str(POLICY)},
            "tracking": section,
        },
    )


def tokenizer() -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(POLICY / "tokenizer.json"))


@dataclass
class Published:
    """What a fake run put on its streams, for the tests to compare against."""

    metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> values
    train: list[schemas.RewardPoint] = field(default_factory=list)
    val: list[schemas.RewardPoint] = field(default_factory=list)
    trajectories: list[schemas.Trajectory] = field(default_factory=list)
    texts: dict[str, tuple[str, str]] = field(default_factory=dict)  # attempt key -> (prompt, rest)


def trajectory(
    run: str, key: int, version: int, reward: float, tok: Any
) -> tuple[schemas.Trajectory, str, str]:
    """A two-call attempt (tool call, then answer), tokenized as the gateway records it."""
    a, b = 10 + key, 7 + version
    prompt = f"<|im_start|>user\nWhat is {a} * {b}?<|im_end|>\n<|im_start|>assistant\n"
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call><|im_end|>'
    tool = (
        f"\n<|im_start|>user\n<tool_response>\n{a * b}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    answer = f"The answer is {a * b}.<|im_end|>"
    ids = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    first, call_ids = ids(prompt), ids(call)
    second = first + call_ids + ids(tool)
    turns = [
        schemas.Turn(model="policy", prompt_ids=schemas.pack_tokens(p), response_ids=schemas.pack_tokens(r),
                     response_logprobs=schemas.pack_logprobs([-0.5] * len(r)), version=version)
        for p, r in ((first, call_ids), (second, ids(answer)))
    ]  # fmt: skip
    t = schemas.Trajectory(
        run=run, task_id=f"g{key}:0", group_id=f"g{key}", sample_id=f"s{key}", index=0, group_size=1,
        attempt=0, runner_id="r0", status="ok", reward=reward, turns=turns, min_version=version,
    )  # fmt: skip
    return t, prompt, call + tool + answer


def publish_steps(
    r: redis.Redis, keys: Keys, steps: range, *, per_version: int = 3, into: Published | None = None
) -> Published:
    """For each step s: trainer metrics at step s (version s), `per_version` trajectories and
    train reward points sampled with version s - 1, a validation round every other version,
    the ledger counts and the trainer's version, in the order the services write them."""
    out = into or Published()
    tok = tokenizer()
    for step in steps:
        version = step - 1
        for i in range(per_version):
            key = step * 100 + i
            reward = ((key * 7) % 10) / 10
            t, prompt, rest = trajectory(keys.run, key, version, reward, tok)
            bus.publish(r, keys.trajectories, t)
            out.trajectories.append(t)
            out.texts[t.key] = (prompt, rest)
            point = schemas.RewardPoint(
                run=keys.run, version=version, mode="train", mean=reward, count=1, group_id=t.group_id
            )
            bus.publish(r, keys.rewards, point)
            out.train.append(point)
        values = {"loss": 1.0 / step, "reward_mean": 0.1 * step, "filtered:zero_variance": float(step % 2)}
        bus.publish(r, keys.metrics, schemas.Metrics(run=keys.run, step=step, version=step, values=values))
        out.metrics[step] = values
        if version % 2 == 0:
            point = schemas.RewardPoint(
                run=keys.run,
                version=version,
                mode="val",
                mean=0.25 + 0.05 * version,
                count=4,
                group_id=f"round{version}",
            )
            bus.publish(r, keys.rewards, point)
            out.val.append(point)
        r.hset(keys.ledger, mapping={"dispatched": step * per_version, "trained": step * per_version})
        r.hset(keys.versions, "trainer", step)
        time.sleep(0.002)  # distinct entry ids across steps, as real services produce them
    return out

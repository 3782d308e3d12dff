"""What the tracker reads: new entries of `metrics`, `rewards` and `trajectories` after the
cursor (XRANGE with an exclusive start, no consumer group, so it never holds back trimming),
the ledger counts and the trainer's version (shared.runstate), and rollouts decoded to text.

Every reader returns plain records and the id of the last entry it looked at; an entry that
does not decode is skipped (and counted), never an error: tracking must not stop on one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from squall.shared import schemas
from squall.shared.errors import ConfigError
from squall.shared.roles import DEFAULT_ROLE

BATCH = 256  # entries per XRANGE
MAX_ENTRIES_PER_POLL = 4096  # per stream: a poll stays short; the rest comes next poll

SAMPLE_COLUMNS = ("version", "mode", "attempt", "status", "reward", "turns", "prompt", "response")


@dataclass(frozen=True)
class Scalars:
    """Values logged together against one x-axis: `trainer/step` or `version`."""

    axis: str  # "step" (trainer optimizer step) or "version" (policy weight version)
    step: int
    values: dict[str, float]  # finite values only


@dataclass(frozen=True)
class SampleRow:
    """One rollout as text (a row of the samples table)."""

    version: int  # policy version that sampled it (newest version among its trained turns)
    mode: str  # train | val
    attempt: str  # task_id#attempt
    status: str  # ok | failed | timeout | cancelled
    reward: float | None
    turns: int  # LLM calls in the attempt
    prompt: str  # the first call's prompt, as the model saw it
    response: str  # everything after it: responses, tool results, later responses

    def cells(self) -> list[Any]:
        return [getattr(self, name) for name in SAMPLE_COLUMNS]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def entries_after(r: redis.Redis, stream: str, last_id: str) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Entries of `stream` after `last_id`, oldest first, at most MAX_ENTRIES_PER_POLL."""
    seen = 0
    while seen < MAX_ENTRIES_PER_POLL:
        batch = r.xrange(stream, min=f"({last_id}", count=BATCH)
        for entry_id, fields in batch:  # type: ignore[union-attr]
            last_id = _text(entry_id)
            seen += 1
            yield last_id, fields
        if len(batch) < BATCH:  # type: ignore[arg-type]
            return


def finite(values: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}


def metrics_scalars(message: schemas.Metrics) -> Scalars:
    """A trainer step's metrics as `trainer/<name>`; a role's step ([roles] runs, each role
    with its own step and version counter) as `trainer/<role>/<name>`."""
    prefix = "trainer" if message.role == DEFAULT_ROLE else f"trainer/{message.role}"
    values = {f"{prefix}/{name}": value for name, value in finite(message.values).items()}
    values[f"{prefix}/version"] = float(message.version)
    return Scalars("step", message.step, values)


def reward_scalars(point: schemas.RewardPoint) -> Scalars:
    """A train group's mean (`reward/train`) or a validation round's (`reward/val`), with its
    count; a role's own ([roles] runs) as `reward/<role>/train`, `reward/<role>/val`."""
    prefix = f"reward/{point.role}" if point.role else "reward"
    values = {f"{prefix}/{point.mode}_count": float(point.count)}
    if math.isfinite(point.mean):
        values[f"{prefix}/{point.mode}"] = float(point.mean)
    return Scalars("version", point.version, values)


def ledger_scalars(version: int, counts: dict[str, int]) -> Scalars:
    return Scalars("version", version, {f"ledger/{state}": float(n) for state, n in sorted(counts.items())})


def policy_version(trajectory: schemas.Trajectory) -> int:
    versions = [t.version for t in trajectory.turns if t.trained and t.version >= 0]
    return max(versions) if versions else trajectory.min_version


class TextDecoder:
    """Token ids -> text with the run's tokenizer (`tokenizer.json` of model.path, read with
    `tokenizers` alone; transformers' AutoTokenizer when the folder has no tokenizer.json)."""

    def __init__(self, model_dir: str) -> None:
        folder = Path(model_dir) if model_dir else None
        if folder is None or not folder.is_dir():
            raise ConfigError(
                f"model.path {model_dir!r} is not a folder: rollout samples need the run's tokenizer; "
                "set model.path or tracking.samples_per_version = 0"
            )
        if (folder / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        else:
            from transformers import AutoTokenizer

            auto = AutoTokenizer.from_pretrained(str(folder))
            self._decode = lambda ids: auto.decode(ids, skip_special_tokens=False)

    def __call__(self, ids: Any) -> str:
        return self._decode([int(i) for i in ids])


def sample_row(trajectory: schemas.Trajectory, text: TextDecoder) -> SampleRow:
    """The attempt as (prompt, response) text. When the last call's prompt extends the first's
    (a multi-turn chat), the response is that extension plus the last response: the whole
    exchange as the model saw it; otherwise the calls' responses, one per line."""
    turns = trajectory.turns
    prompt = response = ""
    if turns:
        first, last = turns[0].prompt_tokens, turns[-1].prompt_tokens
        prompt = text(first)
        if len(last) >= len(first) and (last[: len(first)] == first).all():
            response = text(list(last[len(first) :]) + list(turns[-1].response_tokens))
        else:
            response = "\n".join(text(t.response_tokens) for t in turns)
    return SampleRow(
        version=policy_version(trajectory),
        mode=trajectory.mode,
        attempt=trajectory.key,
        status=trajectory.status,
        reward=trajectory.reward,
        turns=len(turns),
        prompt=prompt,
        response=response,
    )

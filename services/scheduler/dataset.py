"""Datasets: rows from JSONL or Parquet, a seeded validation split and per-epoch order.

A row is a dict and becomes a Task's payload unchanged, so verl-style rows
(``prompt``: chat messages, ``reward_model.ground_truth``, ``data_source``, ``extra_info``)
reach the agent as they are. A row's id is its ``id`` field (or ``extra_info.index``),
else its position in the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from squall.shared.errors import ConfigError


@dataclass(frozen=True)
class Sample:
    """One dataset row with a stable id."""

    sample_id: str  # the row's own id, or its position in the file
    row: dict[str, Any]  # the row as read, msgpack-serialisable


def load_rows(path: str | Path) -> list[Sample]:
    """Every row of a .jsonl or .parquet file; a bad file raises ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"dataset {path} does not exist: set scheduler.dataset to a .jsonl or .parquet file"
        )
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        rows = _read_jsonl(path)
    elif path.suffix in (".parquet", ".pq"):
        rows = _read_parquet(path)
    else:
        raise ConfigError(f"dataset {path}: unknown format {path.suffix!r} (use .jsonl or .parquet)")
    return [Sample(_row_id(row, i), row) for i, row in enumerate(rows)]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open() as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"dataset {path} line {line_no} is not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"dataset {path} line {line_no}: a row must be a JSON object")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return [_plain(row) for row in pq.read_table(path).to_pylist()]


def _plain(value: Any) -> Any:
    """Parquet values as msgpack-friendly Python: numpy scalars/arrays and NaN floats tamed."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bytes, str, int, float, bool)) or value is None:
        return value
    return str(value)  # dates, decimals: their text form


def _row_id(row: dict[str, Any], position: int) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])
    return str(position)


def ground_truth(row: dict[str, Any]) -> Any:
    """The reference answer of a row: verl's reward_model.ground_truth, else `answer`/`ground_truth`."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return row.get("ground_truth", row.get("answer"))


@dataclass(frozen=True)
class Splits:
    train: list[Sample]
    val: list[Sample]


def split(train: list[Sample], val: list[Sample] | None, val_fraction: float, seed: int) -> Splits:
    """Use `val` when given, else carve a seeded `val_fraction` of `train` out for validation."""
    if val is not None or val_fraction <= 0:
        return Splits(train, val or [])
    order = np.random.default_rng([seed, 7919]).permutation(len(train))
    n_val = max(1, round(len(train) * val_fraction)) if train else 0
    held = set(order[:n_val].tolist())
    return Splits(
        [s for i, s in enumerate(train) if i not in held],
        [s for i, s in enumerate(train) if i in held],
    )


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Row positions for one epoch: the same (seed, epoch) always gives the same order."""
    if not shuffle:
        return list(range(n))
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()

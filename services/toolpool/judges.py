"""Judges: score a prediction against a reference, looked up by name (pure functions, no I/O,
except `sql`, which runs both queries on the pool's read-only database)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from squall.shared.errors import ToolError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD normalisation)."""
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact(prediction: Any, reference: Any) -> float:
    """1 when the normalised texts are equal."""
    return float(normalize(prediction) == normalize(reference))


def contains(prediction: Any, reference: Any) -> float:
    """1 when the normalised reference occurs in the normalised prediction."""
    return float(bool(normalize(reference)) and normalize(reference) in normalize(prediction))


def number(prediction: Any, reference: Any) -> float:
    """1 when the last number in the prediction equals the reference (to 1e-6)."""
    found = _NUMBER.findall(str(prediction).replace(",", ""))
    try:
        return float(bool(found) and abs(float(found[-1]) - float(reference)) < 1e-6)
    except (TypeError, ValueError):
        return 0.0


def f1(prediction: Any, reference: Any) -> float:
    """Token F1 of the normalised texts."""
    pred, ref = normalize(prediction).split(), normalize(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or not common:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def result_rows(rows: list[list[Any]]) -> Counter:
    """A query result as a multiset of rows (order ignored; numbers compared rounded)."""
    return Counter(tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows)


JUDGES: dict[str, Callable[[Any, Any], float]] = {
    "exact": exact,
    "contains": contains,
    "number": number,
    "f1": f1,
}
KNOWN = (*JUDGES, "sql")  # `sql` needs a database: see jobs.judge


def by_name(kind: str) -> Callable[[Any, Any], float]:
    if kind not in JUDGES:
        raise ToolError(f"unknown judge {kind!r}: known judges are {list(KNOWN)}")
    return JUDGES[kind]

"""Run warnings: a problem a run cannot fix by itself, said once per run where people look.

A warning is one field of the run's `warnings` hash: field `<kind>:<subject>`, value a
`RunWarning` as JSON. The first process that sees the problem writes it with HSETNX, so however
many processes see it, one logs it (the one whose write went in) and the hash keeps it for
`squall status` and the dashboard (both through shared.runstate) until the run's keys go.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import redis

from .keys import Keys

# Kinds of warning (the field's prefix).
TRAIN_AGENT_UNUSED = "train_agent_unused"  # a runner.train_agents entry no call came from
AGENT_FAILING = "agent_failing"  # an agent failed runner.agent_failing_after attempts in a row


@dataclass(frozen=True)
class RunWarning:
    kind: str  # one of the kinds above
    subject: str  # what it is about (an agent name, ...)
    message: str  # what is wrong and what to do, for people
    time: float  # wall clock when it was raised
    by: str  # the process that raised it (`runner:<id>`)

    @property
    def field(self) -> str:
        return f"{self.kind}:{self.subject}"

    def fields(self) -> dict[str, Any]:
        """As plain data, for `squall status --json` and the dashboard."""
        return asdict(self)


def record_once(r: redis.Redis, keys: Keys, warning: RunWarning) -> bool:
    """Record `warning` unless this run already has it; True when this call recorded it (the
    caller then logs it: that is the once-per-run log line)."""
    return bool(r.hsetnx(keys.warnings, warning.field, json.dumps(asdict(warning))))


def _decode(raw: Any) -> RunWarning | None:
    try:
        fields = json.loads(raw)
        return RunWarning(**{name: fields[name] for name in RunWarning.__dataclass_fields__})
    except (ValueError, TypeError, KeyError):
        return None


def read_warnings(r: redis.Redis, keys: Keys, skipped: dict[str, int]) -> list[RunWarning]:
    """The run's warnings, oldest first; a field that does not decode is counted in
    `skipped['warnings']` and left out."""
    out = []
    for raw in r.hgetall(keys.warnings).values():  # type: ignore[union-attr]
        warning = _decode(raw)
        if warning is None:
            skipped["warnings"] = skipped.get("warnings", 0) + 1
            continue
        out.append(warning)
    return sorted(out, key=lambda w: w.time)

"""Per-role rewards: how an agent of a run with several trained roles rewards each of them.

With `[roles]` in the run file, an agent may return a table `{role: reward}` (e.g.
`{"villagers": 1.0, "wolves": 0.0}`) instead of one number. It must name every role, with a
finite number each. The trajectory then carries them as `role_rewards` (each role's sample of
the attempt trains with its own), and its `reward` — what validation rounds, the reward curve
and the scheduler see — is their mean. One number (returned, emitted, or from `reward_fn`)
rewards every role alike, exactly as a single-policy run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .agents import AgentError


def split_role_rewards(returned: Any, roles: Sequence[str]) -> tuple[Any, dict[str, float]]:
    """(what the ordinary reward path gets, the per-role rewards): a table returned by the agent
    becomes its mean and the table; anything else passes through with no per-role rewards.
    AgentError naming the role when the table is not one finite number per role of the run."""
    if not isinstance(returned, Mapping):
        return returned, {}
    if not roles:
        raise AgentError(
            "agent returned a table of rewards, but the run declares no [roles]: return one number"
        )
    unknown = sorted(str(k) for k in returned if k not in roles)
    if unknown:
        raise AgentError(
            f"agent's reward table names {unknown}, which are not roles of this run (roles: {list(roles)})"
        )
    missing = [role for role in roles if role not in returned]
    if missing:
        raise AgentError(f"agent's reward table has no reward for role(s) {missing}: give every role one")
    out: dict[str, float] = {}
    for role in roles:
        value = returned[role]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise AgentError(f"agent's reward for role {role!r} is {value!r}: it must be a finite number")
        out[role] = float(value)
    return sum(out.values()) / len(out), out

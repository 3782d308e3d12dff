"""Turn-level rewards: a reward the agent emits attaches to the call it follows.

`llm.emit_reward(x)` (function agents) and `POST {OPENAI_BASE_URL}/reward` with
`{"reward": x}` (command agents; the URL is also in `$AGENT_REWARD_URL`) both
land here. A reward is added to the newest recorded Turn of the attempt (several rewards
before the next call add up on that turn); the attempt's reward is the sum of everything
emitted plus what the agent returned (runner/agents.py `resolve_reward`).

Bad input never stops the run: a reward that is not a finite number, or one emitted before
any model call, raises TurnRewardError naming the call, which fails only that attempt (or,
over HTTP, answers 400 and leaves the attempt running).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from squall.shared.schemas import Turn


class TurnRewardError(ValueError):
    """An emitted reward that cannot be attached: its message names the call and the fix."""


def attach_reward(turns: Sequence[Turn], value: Any, where: str = "llm.emit_reward") -> int:
    """Add `value` to the newest turn's reward; returns that turn's index."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TurnRewardError(
            f"{where}({str(value)[:50]!r}): a reward must be a number, got {type(value).__name__}"
        )
    value = float(value)
    if not math.isfinite(value):
        raise TurnRewardError(f"{where}({value}): a reward must be a finite number")
    if not turns:
        raise TurnRewardError(
            f"{where}({value}) before any model call: a turn reward attaches to the call it follows; "
            "make a call first, or return the reward from the agent instead"
        )
    turn = turns[-1]
    turn.reward = value if turn.reward is None else turn.reward + value
    return len(turns) - 1


def emitted_total(turns: Sequence[Turn]) -> float | None:
    """The sum of the rewards emitted on `turns`, None when none was."""
    emitted = [t.reward for t in turns if t.reward is not None]
    return float(sum(emitted)) if emitted else None

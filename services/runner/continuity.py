"""Token continuity: does a call's prompt continue the same agent's previous call token for token?

The trainer merges an agent's consecutive trained turns into one sequence when turn k+1's
prompt starts with turn k's prompt + response (trainer/sequences.py). A client that rewrites or
re-renders its history (an edited reply, a dropped thinking block, a protocol whose history
re-renders differently) breaks that; the gateway marks each trained Turn's `extends` here, and
counts and logs the breaks, so they are visible rather than silently trained as new samples.
"""

from __future__ import annotations

import numpy as np

from squall.shared.schemas import Turn, unpack_tokens


def mark_last(turns: list[Turn]) -> tuple[int, int] | None:
    """Set `extends` on the last turn; returns (first differing position, history length) when
    it is a trained turn that does not extend its agent's previous trained turn, else None."""
    turn = turns[-1]
    if not turn.trained:
        return None
    previous = next((t for t in reversed(turns[:-1]) if t.trained and t.agent == turn.agent), None)
    if previous is None:
        return None
    history = previous.prompt_ids + previous.response_ids  # packed int32: a bytes prefix test
    turn.extends = turn.prompt_ids.startswith(history)
    if turn.extends:
        return None
    prompt, past = turn.prompt_tokens, unpack_tokens(history)
    size = min(len(prompt), len(past))
    differ = np.flatnonzero(prompt[:size] != past[:size])
    return (int(differ[0]) if differ.size else size), len(past)

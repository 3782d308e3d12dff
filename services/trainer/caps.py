"""Transition caps: which trained turns of a trajectory stay trained. Pure: no I/O.

Two per-run caps, applied to each member before it is turned into samples:
- `max_turn_tokens`: a turn whose prompt + response is longer is not trained (counted as
  ``capped:turn_tokens``); it stays in the trajectory, so its tokens are still the context of
  later turns of the same agent, with loss mask 0 (sequences.py);
- `max_turns_per_trajectory` K: of the turns still trained, K are kept by a sample seeded
  with the run seed and the attempt key, the others untrained (``capped:turns``). The seed
  makes the choice the same on every replay of the same attempt (a restart re-decides a group
  and must train exactly what it would have).
A member that had trained turns and has none left is filtered as ``no_turns_in_cap``
(filters.py). A cap of 0 is off.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from squall.shared.schemas import Trajectory, Turn

TURN_TOKENS = "capped:turn_tokens"  # metric: turns over max_turn_tokens
TURNS = "capped:turns"  # metric: turns past max_turns_per_trajectory


@dataclass(frozen=True)
class TurnCaps:
    max_turn_tokens: int = 0  # 0: no cap on one turn's prompt + response tokens
    max_turns: int = 0  # 0: no cap on trained turns per trajectory
    seed: int = 0  # the run seed; with the attempt key it seeds the turn sample

    @property
    def active(self) -> bool:
        return bool(self.max_turn_tokens or self.max_turns)


def turn_tokens(turn: Turn) -> int:
    """Prompt + response tokens of one turn (the ids are packed int32)."""
    return (len(turn.prompt_ids) + len(turn.response_ids)) // 4


def sample_seed(seed: int, key: str) -> int:
    """A seed that depends only on the run seed and the attempt key (not on PYTHONHASHSEED)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def capped_flags(turns: Sequence[Turn], caps: TurnCaps, key: str) -> tuple[list[bool], Counter]:
    """The trained flag of each turn after the caps, and the dropped turns by metric name."""
    keep = [t.trained for t in turns]
    dropped: Counter = Counter()
    if caps.max_turn_tokens:
        for i, turn in enumerate(turns):
            if keep[i] and turn_tokens(turn) > caps.max_turn_tokens:
                keep[i] = False
                dropped[TURN_TOKENS] += 1
    trained = [i for i, k in enumerate(keep) if k]
    if caps.max_turns and len(trained) > caps.max_turns:
        chosen = set(random.Random(sample_seed(caps.seed, key)).sample(trained, caps.max_turns))
        for i in trained:
            if i not in chosen:
                keep[i] = False
                dropped[TURNS] += 1
    return keep, dropped


def apply_caps(trajectory: Trajectory, caps: TurnCaps) -> tuple[Trajectory, Counter]:
    """The trajectory with capped turns marked untrained (the input is not changed)."""
    if not caps.active:
        return trajectory, Counter()
    keep, dropped = capped_flags(trajectory.turns, caps, trajectory.key)
    if not dropped:
        return trajectory, dropped
    turns = [
        t if t.trained == k else msgspec.structs.replace(t, trained=k)
        for t, k in zip(trajectory.turns, keep, strict=True)
    ]
    return msgspec.structs.replace(trajectory, turns=turns), dropped

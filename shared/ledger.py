"""The ledger: every dispatched attempt is in exactly one state, counted in one hash.

This module is the one owner of the attempt life cycle: the states (`State`), the reasons an
attempt may be filtered (`FilterReason`), the table of allowed moves (`TRANSITIONS`: who may
move an attempt from which states to which one) and the one implementation of the atomic move
(`Ledger.apply`, also usable inside a caller's MULTI/EXEC, and `lua_move_function` for
scripts that must move an attempt together with other writes, like the runner's finish).

Attempts are identified by their key ``task_id#attempt``. A move changes one attempt's state
and adjusts both counters in the same atomic script, so the counts always add up to the
number of attempts ever dispatched (conservation), and replaying a move after a crash changes
nothing (exactly-once effect): an attempt already in the target state, or in a state the move
does not start from, is left alone.

Life cycle (actor in brackets):

    new --dispatch[scheduler]--> pending --take[runner]--> running
    pending|running --finish[runner]--> ok | failed | timeout
    failed|timeout|cancelled --retry[scheduler]--> retried     (a new attempt is dispatched)
    failed|timeout|cancelled --give_up[scheduler]--> deadlettered
    ok --validate[scheduler]--> validated                        (val attempts)
    new|pending|running|ok --train|late|filter|reject[trainer]--> trained | late |
                                                          filtered:<reason> | deadlettered

The trainer may start from `new`/`pending`/`running` because its durable checkpoint, not the
runner's ledger write, is the authority on what was trained; it never moves `failed`,
`timeout` or `cancelled` attempts, which the scheduler owns (retry or dead-letter), so the
two never overwrite each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis

from .keys import Keys


class State(StrEnum):
    """Where one attempt is. The value is also the counter's name in the ledger hash."""

    NEW = "new"  # not in the attempts hash yet (only ever a source of a move)
    PENDING = "pending"  # dispatched, in `tasks`, not yet taken by a runner
    RUNNING = "running"  # a runner took it (lease held)
    OK = "ok"  # finished with a reward; waiting for the trainer (train) or scheduler (val)
    FAILED = "failed"  # finished with an error -> retried | deadlettered
    TIMEOUT = "timeout"  # ran past its deadline -> retried | deadlettered
    CANCELLED = "cancelled"  # given up before it finished -> retried | deadlettered
    RETRIED = "retried"  # a new attempt of the same member was dispatched
    DEADLETTERED = "deadlettered"  # out of tries, or unprocessable
    LATE = "late"  # finished after its group completed: counted, never trained
    VALIDATED = "validated"  # a val attempt whose reward was recorded
    TRAINED = "trained"  # used in an optimizer step that is durably checkpointed


FILTERED_PREFIX = "filtered:"  # filtered states are spelled filtered:<reason>, in the ledger and metrics


class FilterReason(StrEnum):
    """Why the trainer left an attempt out (the state is ``filtered:<reason>``)."""

    ZERO_VARIANCE = "zero_variance"  # its group's rewards are all equal: no signal
    STALE = "stale"  # sampled by a policy older than max_staleness allows
    OVERLONG = "overlong"  # truncated or longer than max_seq_len
    NO_TRAINED_TURNS = "no_trained_turns"  # no turn recorded by the trained policy
    NO_TRAINED_TOKENS = "no_trained_tokens"  # every token masked out
    NO_TURNS_IN_CAP = "no_turns_in_cap"  # every trained turn dropped by the trainer's transition caps
    SFT_BELOW_THRESHOLD = "sft_below_threshold"  # trainer.sft = "only": reward below sft_threshold
    SFT_DUPLICATE = "sft_duplicate"  # SFT: the same trained tokens were already chosen
    # A failed/timeout/cancelled member: consumed by the trainer, but its ledger state stays
    # the scheduler's (retry or dead-letter), so these reasons never become a state.
    FAILED = "failed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"


SCHEDULER_OWNED_REASONS = frozenset({FilterReason.FAILED, FilterReason.TIMEOUT, FilterReason.CANCELLED})


def filtered_state(reason: str) -> str:
    """The ledger state (and metric name) of an attempt filtered for `reason`."""
    FilterReason(reason)  # a ValueError names an unknown reason
    return f"{FILTERED_PREFIX}{reason}"


TERMINAL_STATES = (
    State.RETRIED,
    State.DEADLETTERED,
    State.CANCELLED,
    State.LATE,
    State.VALIDATED,
    State.TRAINED,
)


class Actor(StrEnum):
    SCHEDULER = "scheduler"
    RUNNER = "runner"
    TRAINER = "trainer"


@dataclass(frozen=True)
class Transition:
    """One allowed move: `actor` moves an attempt from any of `sources` to `target`.

    `target` None means ``filtered:<reason>`` with the reason given at the call.
    """

    name: str
    actor: Actor
    sources: frozenset[State]
    target: State | None

    def target_state(self, reason: str | None = None) -> str:
        if self.target is None:
            if reason is None:
                raise ValueError(f"ledger move {self.name!r} needs a filter reason")
            if reason in SCHEDULER_OWNED_REASONS:
                raise ValueError(f"filter reason {reason!r} is the scheduler's to settle, not a ledger state")
            return filtered_state(reason)
        if reason is not None:
            raise ValueError(f"ledger move {self.name!r} takes no reason (got {reason!r})")
        return self.target.value


_FINISHED = frozenset({State.FAILED, State.TIMEOUT, State.CANCELLED})
_TRAINER_SOURCES = frozenset({State.NEW, State.PENDING, State.RUNNING, State.OK})
_TAKEN = frozenset({State.PENDING, State.RUNNING})


def _t(name: str, actor: Actor, sources: Iterable[State], target: State | None) -> Transition:
    return Transition(name, actor, frozenset(sources), target)


TRANSITIONS: dict[str, Transition] = {
    t.name: t
    for t in (
        _t("dispatch", Actor.SCHEDULER, {State.NEW}, State.PENDING),
        _t("take", Actor.RUNNER, {State.PENDING}, State.RUNNING),
        _t("finish_ok", Actor.RUNNER, _TAKEN, State.OK),
        _t("finish_failed", Actor.RUNNER, _TAKEN, State.FAILED),
        _t("finish_timeout", Actor.RUNNER, _TAKEN, State.TIMEOUT),
        _t("retry", Actor.SCHEDULER, _FINISHED, State.RETRIED),
        _t("give_up", Actor.SCHEDULER, _FINISHED, State.DEADLETTERED),
        _t("validate", Actor.SCHEDULER, {State.OK}, State.VALIDATED),
        _t("train", Actor.TRAINER, _TRAINER_SOURCES, State.TRAINED),
        _t("late", Actor.TRAINER, _TRAINER_SOURCES, State.LATE),
        _t("filter", Actor.TRAINER, _TRAINER_SOURCES, None),
        _t("reject", Actor.TRAINER, _TRAINER_SOURCES, State.DEADLETTERED),
    )
}

# The runner publishes a trajectory and moves its attempt in one script: by status.
FINISH_BY_STATUS = {
    "ok": TRANSITIONS["finish_ok"],
    "failed": TRANSITIONS["finish_failed"],
    "timeout": TRANSITIONS["finish_timeout"],
}


def transition(name: str) -> Transition:
    """The table's entry `name`; an unknown name lists the known ones."""
    try:
        return TRANSITIONS[name]
    except KeyError:
        raise KeyError(f"unknown ledger move {name!r}; known: {', '.join(TRANSITIONS)}") from None


# A Lua function, `squall_move(attempts, ledger, key, target, sources)`, where `sources` is a
# Lua set of state names ('new' = a key not in the attempts hash). Scripts that move an
# attempt together with other writes include it (see `lua_move_function`).
_LUA_MOVE = """
local function squall_move(attempts, ledger, key, target, sources)
  local old = redis.call('HGET', attempts, key)
  if old == target or not sources[old or 'new'] then return 0 end
  if old then redis.call('HINCRBY', ledger, old, -1) end
  redis.call('HSET', attempts, key, target)
  redis.call('HINCRBY', ledger, target, 1)
  if not old then redis.call('HINCRBY', ledger, 'dispatched', 1) end
  return 1
end
"""


def lua_move_function() -> str:
    """The Lua text of `squall_move`, for scripts that move an attempt among other writes."""
    return _LUA_MOVE


def lua_sources(states: Iterable[str]) -> str:
    """A Lua set literal of state names, e.g. ``{['pending']=true, ['running']=true}``."""
    return "{" + ", ".join(f"['{s}']=true" for s in sorted(str(s) for s in states)) + "}"


# KEYS[1] attempts hash, KEYS[2] ledger hash; ARGV[1] target state, ARGV[2] comma-separated
# source states ("" = any), then attempt keys. Returns how many attempts moved.
_MOVE_SCRIPT = (
    _LUA_MOVE
    + """
local sources = {}
for s in string.gmatch(ARGV[2], '[^,]+') do sources[s] = true end
if ARGV[2] == '' then setmetatable(sources, {__index = function() return true end}) end
local moved = 0
for i = 3, #ARGV do
  moved = moved + squall_move(KEYS[1], KEYS[2], ARGV[i], ARGV[1], sources)
end
return moved
"""
)


class Ledger:
    """Atomic state moves of attempts and the counts per state."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self._script = r.register_script(_MOVE_SCRIPT)

    def apply(
        self,
        name: str,
        attempt_keys: Iterable[str],
        *,
        reason: str | None = None,
        pipe: redis.client.Pipeline | None = None,
    ) -> int | None:
        """Make the table's move `name` on `attempt_keys` (a filter move takes `reason`).

        Returns how many moved, or None when queued on `pipe` (e.g. a MULTI/EXEC holding the
        XADDs the move belongs to). Every service's ledger writes go through here.
        """
        move = transition(name)
        return self._run(attempt_keys, move.target_state(reason), move.sources, pipe)

    def move(self, attempt_keys: Iterable[str], state: str, *, allowed_from: Iterable[str] = ()) -> int:
        """A raw move outside the table, for tools and tests that set up a state (services use
        `apply`): to `state`, from `allowed_from` only when given ('new' = unknown key)."""
        return int(self._run(attempt_keys, state, allowed_from, None) or 0)

    def move_in(
        self,
        pipe: redis.client.Pipeline,
        attempt_keys: Iterable[str],
        state: str,
        *,
        allowed_from: Iterable[str] = (),
    ) -> None:
        """`move`, queued on `pipe`."""
        self._run(attempt_keys, state, allowed_from, pipe)

    def filtered(self, attempt_keys: Iterable[str], reason: str) -> int:
        return self.move(attempt_keys, filtered_state(reason))

    def _run(self, attempt_keys: Iterable[str], state: str, sources: Iterable[str], pipe: Any) -> int | None:
        keys = list(attempt_keys)
        if not keys:
            return None if pipe is not None else 0
        args = [str(state), ",".join(sorted(str(s) for s in sources)), *keys]
        result = self._script(keys=[self.keys.attempts, self.keys.ledger], args=args, client=pipe)
        return None if pipe is not None else int(result)

    def state_of(self, attempt_key: str) -> str | None:
        value: bytes | None = self.r.hget(self.keys.attempts, attempt_key)  # type: ignore[assignment]
        return value.decode() if value is not None else None

    def counts(self) -> dict[str, int]:
        """State -> attempts in it, plus `dispatched` (every attempt ever dispatched)."""
        raw: dict[bytes, bytes] = self.r.hgetall(self.keys.ledger)  # type: ignore[assignment]
        return {k.decode(): int(v) for k, v in raw.items() if int(v) or k == b"dispatched"}

    def balanced(self) -> bool:
        """Conservation: the states add up to the attempts dispatched."""
        counts = self.counts()
        dispatched = counts.pop("dispatched", 0)
        return sum(counts.values()) == dispatched

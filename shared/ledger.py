"""The ledger: every dispatched attempt is in exactly one state, counted in one hash.

Attempts are identified by their key ``task_id#attempt``. A transition moves one attempt
from its current state to a new one and adjusts both counters in the same atomic script,
so the counts always add up to the number of attempts ever dispatched (conservation),
and replaying a transition after a crash changes nothing (exactly-once effect).

States (strings, also the counter names in the ledger hash):
  pending      dispatched, in `tasks`, not yet taken by a runner
  running      a runner took it (lease held)
  ok           finished with a reward, waiting for the trainer (train) / recorded (val)
  failed       finished with an error           -> retried | deadlettered
  timeout      ran past its deadline           -> retried | deadlettered
  retried      a new attempt of the same member was dispatched (that one counts on its own)
  deadlettered out of tries, or unprocessable
  cancelled    given up by the scheduler (e.g. run drained)
  late         finished after its group completed: counted, never trained
  validated    a val attempt whose reward was recorded
  trained      used in an optimizer step that is durably checkpointed
  filtered:<reason>  seen by the trainer and left out (zero_variance, stale, failed, overlong...)
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from .keys import Keys

TERMINAL_STATES = ("retried", "deadlettered", "cancelled", "late", "validated", "trained")

# KEYS[1] attempts hash, KEYS[2] ledger hash; ARGV: new_state, allowed_from ("" = any),
# then attempt keys. Returns how many attempts moved.
_TRANSITION = """
local moved = 0
local allowed = {}
for s in string.gmatch(ARGV[2], '[^,]+') do allowed[s] = true end
local any = ARGV[2] == ''
for i = 3, #ARGV do
  local key = ARGV[i]
  local old = redis.call('HGET', KEYS[1], key)
  if old ~= ARGV[1] and (any or (old and allowed[old]) or (not old and allowed['new'])) then
    if old then redis.call('HINCRBY', KEYS[2], old, -1) end
    redis.call('HSET', KEYS[1], key, ARGV[1])
    redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
    if not old then redis.call('HINCRBY', KEYS[2], 'dispatched', 1) end
    moved = moved + 1
  end
end
return moved
"""


class Ledger:
    """Atomic state transitions of attempts and the counts per state."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self._transition = r.register_script(_TRANSITION)

    def move(self, attempt_keys: Iterable[str], state: str, *, allowed_from: Iterable[str] = ()) -> int:
        """Move attempts to `state`; only from `allowed_from` states when given ('new' = unknown key).

        Returns how many moved; an attempt already in `state` is left alone (idempotent).
        """
        attempt_keys = list(attempt_keys)
        if not attempt_keys:
            return 0
        allowed = ",".join(allowed_from)
        return int(
            self._transition(
                keys=[self.keys.attempts, self.keys.ledger], args=[state, allowed, *attempt_keys]
            )
        )

    def move_in(
        self,
        pipe: redis.client.Pipeline,
        attempt_keys: Iterable[str],
        state: str,
        *,
        allowed_from: Iterable[str] = (),
    ) -> None:
        """Queue the same transition on `pipe` (e.g. a MULTI/EXEC with the XADDs it belongs to)."""
        attempt_keys = list(attempt_keys)
        if attempt_keys:
            allowed = ",".join(allowed_from)
            self._transition(
                keys=[self.keys.attempts, self.keys.ledger], args=[state, allowed, *attempt_keys], client=pipe
            )

    def filtered(self, attempt_keys: Iterable[str], reason: str) -> int:
        return self.move(attempt_keys, f"filtered:{reason}")

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

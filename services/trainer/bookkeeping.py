"""Exactly-once bookkeeping: one object that knows where every trajectory entry is. No I/O.

An entry the trainer read is in exactly one of four places:
- open       its group is still assembling (`assembler`: member key -> entry id)
- waiting    its group is complete and has something to train (`ready`, `entry_ids`)
- next       the next commit covers it (`pending`: entry ids to ack, keys trained, keys
             consumed with their reason, groups closed, counts for the step's metrics)
- durable    a checkpoint on disk covers it (`state`: TrainerState's done set)
Only `seal` moves work from *next* to *durable*, and the caller writes the checkpoint right
after; ledger moves and acks follow the checkpoint (`ledger_moves`). `reset` forgets all but
the durable state, which is what a restart does: every entry not acked is still in the
consumer's pending list and is read again.

The reason -> ledger move mapping is written once here (`ledger_moves`): trained keys go
`train`, late ones `late`, filtered ones `filter` with their reason; failed, timed-out and
cancelled members are the scheduler's to settle (retry or dead-letter), so they get no move.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from squall.shared.ledger import SCHEDULER_OWNED_REASONS, filtered_state
from squall.shared.schemas import Trajectory

from .checkpoint import DoneDelta, TrainerState
from .filters import GroupDecision
from .group_assembly import CompleteGroup, GroupAssembler

LATE = "late"  # the consumed-reason of a member that came after its group completed


class Seen(StrEnum):
    """What the trainer already knows about a key it reads."""

    DONE = "done"  # a durable checkpoint covers it: redo its ledger move, ack
    IN_FLIGHT = "in_flight"  # read before and not committed yet: this is a second copy
    NEW = "new"


def metric_name(reason: str) -> str:
    """The step metric counting members consumed for `reason` (``late``, ``filtered:<reason>``)."""
    return LATE if reason == LATE else filtered_state(reason)


@dataclass
class NextCommit:
    """Work consumed since the last checkpoint; acked and ledgered once one covers it."""

    entry_ids: list[str] = field(default_factory=list)  # stream entries to ack after the commit
    trained: list[str] = field(default_factory=list)  # keys in this step's optimizer update
    # Steps taken since the last checkpoint (trainer.checkpoint_every > 1): key -> its step,
    # and (step, version, keys) per step for trained.jsonl.
    trained_at: dict[str, int] = field(default_factory=dict)
    steps: list[tuple[int, int, list[str]]] = field(default_factory=list)
    consumed: dict[str, str] = field(default_factory=dict)  # key -> filtered reason or 'late'
    groups: list[str] = field(default_factory=list)  # groups this commit closes
    counts: Counter = field(default_factory=Counter)  # filtered:<reason>, late, ... for metrics


@dataclass
class Sealed:
    """One commit's content, once folded into the durable state."""

    done: DoneDelta  # what the checkpoint adds to the done set
    entry_ids: list[str]  # entries to ack once it is durable
    counts: Counter  # for the step's metrics
    steps: list[tuple[int, int, list[str]]] = field(default_factory=list)  # (step, version, keys)


def ledger_moves(done: DoneDelta) -> list[tuple[str, str | None, list[str]]]:
    """The trainer's ledger moves for keys a checkpoint covers: (move, reason, keys)."""
    moves: list[tuple[str, str | None, list[str]]] = []
    if done.trained:
        moves.append(("train", None, list(done.trained)))
    by_reason: dict[str, list[str]] = {}
    for key, reason in done.consumed.items():
        if reason not in SCHEDULER_OWNED_REASONS:
            by_reason.setdefault(reason, []).append(key)
    for reason, keys in by_reason.items():
        moves.append((LATE, None, keys) if reason == LATE else ("filter", reason, keys))
    return moves


class Bookkeeping:
    """Seen, waiting, next commit and durable state of one trainer (see the module doc)."""

    def __init__(self, state: TrainerState, *, group_wait_s: float, max_attempts: int) -> None:
        self.state = state
        self.group_wait_s, self.max_attempts = group_wait_s, max_attempts
        self.reset()

    def reset(self) -> None:
        """Forget everything not durable (after a Redis outage: the entries are read again)."""
        self.assembler = GroupAssembler(
            group_wait_s=self.group_wait_s, max_attempts=self.max_attempts, done_groups=self.state.done_groups
        )
        self.ready: list[GroupDecision] = []  # complete groups with something to train
        self.entry_ids: dict[str, str] = {}  # key -> entry id, members of complete groups
        self.pending = NextCommit()

    # --- intake -----------------------------------------------------------------
    def seen(self, key: str) -> Seen:
        if self.state.is_done(key):
            return Seen.DONE
        pending = self.pending
        if key in self.entry_ids or key in pending.consumed or key in pending.trained_at:
            return Seen.IN_FLIGHT
        return Seen.NEW

    def add(self, entry_id: str, trajectory: Trajectory) -> str:
        """File a train-mode trajectory: 'added', 'late' (consumed now) or 'duplicate'."""
        outcome = self.assembler.add(entry_id, trajectory)
        if outcome == LATE:
            self.consume(entry_id, trajectory.key, LATE)
        return outcome

    def consume(self, entry_id: str, key: str, reason: str) -> None:
        """A member the next commit covers without training it."""
        self.pending.entry_ids.append(entry_id)
        self.pending.consumed[key] = reason
        self.pending.counts[metric_name(reason)] += 1

    def collect(self, decide: Callable[[CompleteGroup], GroupDecision], now: float | None = None) -> None:
        """Decide every group that completed; those with nothing to train join the next commit."""
        for group in self.assembler.pop_complete(now):
            decision = decide(group)
            self.entry_ids.update({m.trajectory.key: m.entry_id for m in group.members})
            if group.timed_out:
                self.pending.counts["groups_timed_out"] += 1
            if decision.train:
                self.ready.append(decision)
            else:  # nothing to wait for: commit the filtered members now
                self._consume_filtered(decision)
                self.pending.groups.append(decision.group_id)

    def _consume_filtered(self, decision: GroupDecision) -> None:
        """Filtered members are committed with their group, never before: a restart then
        re-reads the whole group and recomputes the same baseline."""
        for reason, members in decision.filtered.items():
            for trajectory in members:
                self.consume(self.entry_ids.pop(trajectory.key), trajectory.key, reason)

    # --- one step -------------------------------------------------------------------
    def take_ready(self, groups: int) -> list[GroupDecision]:
        """The oldest `groups` ready groups (their filtered members join the next commit), or
        [] while fewer are ready."""
        if len(self.ready) < groups:
            return []
        taken, self.ready = self.ready[:groups], self.ready[groups:]
        for decision in taken:
            self._consume_filtered(decision)
        return taken

    def train(self, key: str) -> None:
        """A member that goes into this step's update."""
        self.pending.entry_ids.append(self.entry_ids.pop(key))
        self.pending.trained.append(key)

    def drop(self, key: str, reason: str) -> None:
        """A member of a taken group left out after all (e.g. every token masked)."""
        self.consume(self.entry_ids.pop(key), key, reason)

    def close(self, decision: GroupDecision) -> None:
        self.pending.groups.append(decision.group_id)

    def stepped(self, step: int, version: int) -> None:
        """The optimizer step `step` (producing weights `version`) took this step's trained keys;
        they wait in the next commit, with their step, until a checkpoint covers them."""
        pending = self.pending
        pending.trained_at.update({key: step for key in pending.trained})
        pending.steps.append((step, version, pending.trained))
        pending.trained = []

    def take_counts(self) -> Counter:
        """The counts gathered since the last call (one step's metrics), cleared."""
        counts, self.pending.counts = self.pending.counts, Counter()
        return counts

    # --- commit ---------------------------------------------------------------------
    def uncommitted(self) -> bool:
        return bool(self.pending.entry_ids)

    def seal(self, step: int, version: int | None = None) -> Sealed:
        """Fold the next commit into the durable state (keys of steps recorded by `stepped` at
        their step, any others at `step`); the caller writes the checkpoint at once, then
        settles the ledger and acks."""
        pending, self.pending = self.pending, NextCommit()
        steps = list(pending.steps)
        if pending.trained:
            steps.append((step, self.state.version if version is None else version, pending.trained))
        trained = {**pending.trained_at, **{k: step for k in pending.trained}}
        done = DoneDelta(trained, pending.consumed, pending.groups)
        self.state.add(done)
        return Sealed(done, pending.entry_ids, pending.counts, steps)

    def covered(self, keys: Iterable[str]) -> DoneDelta:
        """The durable done set restricted to `keys` (entries read again after a crash)."""
        done = DoneDelta()
        for key in keys:
            if key in self.state.trained:
                done.trained[key] = self.state.trained[key]
            elif key in self.state.consumed:
                done.consumed[key] = self.state.consumed[key]
        return done

"""Outcomes: what one Trajectory (read in group `scheduler`) does to its group.

`decide_outcome` is the decision, a pure function; `Outcomes.record` carries it out as one
MULTI/EXEC (the ledger move, a retry's new task or the dead letter, the group record, a train
group's reward point and the XACK), so a crash before EXEC leaves the trajectory pending in
our PEL to be handled again, and after EXEC everything is done once.

    duplicate  an attempt that is not its member's current one, or a member already settled
               (a late or repeated trajectory): only acked
    record_ok  status ok: the member is done with its reward (val: ledger ok -> validated)
    retry      failed/timeout/cancelled with tries left: ledger -> retried, attempt+1 dispatched
    give_up    failed/timeout/cancelled in all `max_attempts`: ledger -> deadlettered + dead letter
"""

from __future__ import annotations

from enum import StrEnum

import redis

from squall.shared import bus, schemas
from squall.shared.config import SchedulerSection
from squall.shared.keys import GROUP_SCHEDULER, Keys
from squall.shared.ledger import TRANSITIONS, Ledger

from . import report
from .cursor import Cursor
from .dispatch import Dispatcher
from .groups import Group

# Statuses the scheduler settles (retry or dead-letter): the sources of its `retry` move.
FAILED_STATUSES = tuple(sorted(str(s) for s in TRANSITIONS["retry"].sources))


class Outcome(StrEnum):
    DUPLICATE = "duplicate"
    RECORD_OK = "record_ok"
    RETRY = "retry"
    GIVE_UP = "give_up"


def decide_outcome(group: Group | None, traj: schemas.Trajectory, max_attempts: int) -> Outcome:
    """What `traj` does to `group` (None: the group is closed already)."""
    index = traj.index
    if group is None or not 0 <= index < group.size:
        return Outcome.DUPLICATE
    if group.attempts[index] != traj.attempt or group.done[index]:
        return Outcome.DUPLICATE  # counted once already (or by its successor)
    if traj.status == "ok":
        return Outcome.RECORD_OK
    return Outcome.RETRY if traj.attempt + 1 < max_attempts else Outcome.GIVE_UP


def holds(group: Group, hold_until_trained: bool) -> bool:
    """A complete training group stays open (rolled out) until the trainer consumed it."""
    return group.complete and group.mode == "train" and hold_until_trained


class Outcomes:
    """Carries out decisions on the run's keys; the owner keeps the open groups and counts."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        ledger: Ledger,
        section: SchedulerSection,
        dispatcher: Dispatcher,
        log,
    ) -> None:
        self.r, self.keys, self.ledger, self.section = r, keys, ledger, section
        self.dispatcher, self.log = dispatcher, log

    def record(
        self, delivery: bus.Delivery, group: Group, outcome: Outcome, cursor: Cursor, version: int
    ) -> bool:
        """One MULTI/EXEC for a non-duplicate outcome; True when the group leaves the open set."""
        traj: schemas.Trajectory = delivery.message
        pipe = self.r.pipeline(transaction=True)
        if outcome is Outcome.RECORD_OK:
            self._ok(pipe, group, traj)
        elif outcome is Outcome.RETRY:
            self._retry(pipe, group, traj, version)
        else:
            self._give_up(pipe, group, traj, delivery.entry_id)
        hold = holds(group, self.section.hold_until_trained)
        if group.complete:
            group.rolled_out = hold
            self._settle(pipe, group, cursor)
        if hold or not group.complete:
            pipe.hset(self.keys.groups, group.group_id, group.to_json())
        pipe.xack(self.keys.trajectories, GROUP_SCHEDULER, delivery.entry_id)
        pipe.execute()
        return group.complete and not hold

    def _ok(self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory) -> None:
        group.done[traj.index], group.rewards[traj.index] = True, traj.reward
        if group.mode == "val":
            self.ledger.apply("validate", [traj.key], pipe=pipe)

    def _retry(
        self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory, version: int
    ) -> None:
        self.ledger.apply("retry", [traj.key], pipe=pipe)
        group.attempts[traj.index] = traj.attempt + 1
        self.dispatcher.queue(pipe, group, [traj.index], version)
        self.log.info(
            "attempt_retried",
            task_id=traj.task_id,
            attempt=traj.attempt + 1,
            status=traj.status,
            error=traj.error,
        )

    def _give_up(
        self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory, entry_id: str
    ) -> None:
        group.done[traj.index] = True
        self.ledger.apply("give_up", [traj.key], pipe=pipe)
        attempts = self.section.max_attempts
        reason = f"{traj.task_id}: {traj.status} in all {attempts} attempts; last error: {traj.error}"
        bus.dead_letter(
            self.r,
            self.keys.deadletter,
            source=self.keys.trajectories,
            entry_id=entry_id,
            reason=reason,
            raw=schemas.encode(traj),
            group=GROUP_SCHEDULER,
            pipe=pipe,
        )
        self.log.warning("attempt_deadlettered", task_id=traj.task_id, attempts=attempts, error=traj.error)

    def _settle(self, pipe: redis.client.Pipeline, group: Group, cursor: Cursor) -> None:
        """A complete group: its record goes (unless held), its rewards count."""
        if not group.rolled_out:
            pipe.hdel(self.keys.groups, group.group_id)
        rewards = group.ok_rewards()
        if group.mode == "val":
            cursor.val_sum += sum(rewards)
            cursor.val_count += len(rewards)
            pipe.hset(
                self.keys.scheduler_state,
                mapping={"val_sum": str(cursor.val_sum), "val_count": str(cursor.val_count)},
            )
        elif rewards:
            point = schemas.RewardPoint(
                run=self.keys.run,
                version=group.version,
                mode="train",
                mean=sum(rewards) / len(rewards),
                count=len(rewards),
                group_id=group.group_id,
            )
            report.reward(pipe, self.keys, point)

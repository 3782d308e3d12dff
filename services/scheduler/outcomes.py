"""Outcomes: what one Trajectory (read in group `scheduler`) does to its group.

`decide_outcome` is the decision, a pure function; `Outcomes.record` carries it out as one
MULTI/EXEC (the ledger move, a retry's new task or the dead letter, the group record, a train
group's reward point and the XACK), so a crash before EXEC leaves the trajectory pending in
our PEL to be handled again, and after EXEC everything is done once.

    duplicate  an attempt that is not its member's current one, or a member already settled
               (a late or repeated trajectory): only acked
    record_ok  status ok: the member is done with its reward (val: ledger ok -> validated)
    retry      failed/timeout/cancelled with tries left: ledger -> retried, attempt+1 dispatched
    retry_infra  failed because no policy node answered (Trajectory.infra) while the group's
               infrastructure budget lasts (`infra_retries` retries within `infra_retry_s` of
               its first such failure): as retry, but not charged to `max_attempts`, and the
               new task starts only after a backoff (`infra_backoff_s`, doubling per retry of
               the member, at most `infra_backoff_max_s`); counted in the `infra` hash as
               `retried:<reason>`
    give_up    failed/timeout/cancelled in all `max_attempts`: ledger -> deadlettered + dead letter
               (an infrastructure failure past the budget is charged and, if it gives up,
               counted as `given_up:<reason>`)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
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
    RETRY_INFRA = "retry_infra"
    GIVE_UP = "give_up"


@dataclass(frozen=True)
class InfraBudget:
    """How many free infrastructure retries a group gets, and for how long."""

    retries: int  # per group, all members together
    window_s: float  # from the group's first infrastructure failure

    @classmethod
    def of(cls, section: SchedulerSection) -> InfraBudget:
        return cls(section.infra_retries, section.infra_retry_s)

    def allows(self, group: Group, now: float) -> bool:
        if sum(group.infra) >= self.retries:
            return False
        return not group.infra_since or now - group.infra_since < self.window_s


def infra_backoff_s(section: SchedulerSection, retries_so_far: int) -> float:
    """Delay before a member's next infrastructure retry starts."""
    return min(section.infra_backoff_max_s, section.infra_backoff_s * 2 ** min(retries_so_far, 30))


def decide_outcome(
    group: Group | None,
    traj: schemas.Trajectory,
    max_attempts: int,
    budget: InfraBudget | None = None,
    now: float | None = None,
) -> Outcome:
    """What `traj` does to `group` (None: the group is closed already). Without a budget every
    failure is charged to `max_attempts`."""
    index = traj.index
    if group is None or not 0 <= index < group.size:
        return Outcome.DUPLICATE
    if group.attempts[index] != traj.attempt or group.done[index]:
        return Outcome.DUPLICATE  # counted once already (or by its successor)
    if traj.status == "ok":
        return Outcome.RECORD_OK
    if traj.infra and budget is not None and budget.allows(group, time.time() if now is None else now):
        return Outcome.RETRY_INFRA
    charged = traj.attempt + 1 - group.infra_retries(index)  # tries the agent itself used up
    return Outcome.RETRY if charged < max_attempts else Outcome.GIVE_UP


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
        self,
        delivery: bus.Delivery,
        group: Group,
        outcome: Outcome,
        cursor: Cursor,
        version: int,
        also: Callable[[redis.client.Pipeline, Group], None] | None = None,
    ) -> bool:
        """One MULTI/EXEC for a non-duplicate outcome; True when the group leaves the open set.
        `also` adds the owner's writes that must land with it (a validation round's close)."""
        traj: schemas.Trajectory = delivery.message
        pipe = self.r.pipeline(transaction=True)
        if outcome is Outcome.RECORD_OK:
            self._ok(pipe, group, traj)
        elif outcome is Outcome.RETRY:
            self._retry(pipe, group, traj, version)
        elif outcome is Outcome.RETRY_INFRA:
            self._retry_infra(pipe, group, traj, version)
        else:
            self._give_up(pipe, group, traj, delivery.entry_id)
        hold = holds(group, self.section.hold_until_trained)
        if group.complete:
            group.rolled_out = hold
            self._settle(pipe, group, cursor)
        if hold or not group.complete:
            pipe.hset(self.keys.groups, group.group_id, group.to_json())
        if also is not None:
            also(pipe, group)
        pipe.xack(self.keys.trajectories, GROUP_SCHEDULER, delivery.entry_id)
        pipe.execute()
        return group.complete and not hold

    def _ok(self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory) -> None:
        group.done[traj.index], group.rewards[traj.index] = True, traj.reward
        for role, value in traj.role_rewards.items():  # a [roles] run: each role's own reward
            group.role_rewards.setdefault(role, []).append(value)
        if group.mode == "val":
            self.ledger.apply("validate", [traj.key], pipe=pipe)

    def _retry(
        self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory, version: int
    ) -> None:
        self.ledger.apply("retry", [traj.key], pipe=pipe)
        group.attempts[traj.index] = traj.attempt + 1
        self.dispatcher.queue(pipe, group, [traj.index], version)
        if traj.infra:  # past the group's infrastructure budget: charged like the agent's own
            pipe.hincrby(self.keys.infra, f"charged:{traj.infra}", 1)
        self.log.info(
            "attempt_retried",
            task_id=traj.task_id,
            attempt=traj.attempt + 1,
            status=traj.status,
            error=traj.error,
            infra=traj.infra,
        )

    def _retry_infra(
        self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory, version: int
    ) -> None:
        """No policy node answered: a new attempt after a backoff, not charged to max_attempts."""
        if not group.infra:
            group.infra = [0] * group.size
        now = time.time()
        delay = infra_backoff_s(self.section, group.infra[traj.index])
        group.infra[traj.index] += 1
        group.infra_since = group.infra_since or now
        self.ledger.apply("retry", [traj.key], pipe=pipe)
        group.attempts[traj.index] = traj.attempt + 1
        self.dispatcher.queue(pipe, group, [traj.index], version, not_before=now + delay)
        pipe.hincrby(self.keys.infra, f"retried:{traj.infra}", 1)
        self.log.info(
            "attempt_retried_infra",
            task_id=traj.task_id,
            attempt=traj.attempt + 1,
            reason=traj.infra,
            backoff_s=round(delay, 3),
            group_infra_retries=sum(group.infra),
        )

    def _give_up(
        self, pipe: redis.client.Pipeline, group: Group, traj: schemas.Trajectory, entry_id: str
    ) -> None:
        group.done[traj.index] = True
        self.ledger.apply("give_up", [traj.key], pipe=pipe)
        if traj.infra:
            pipe.hincrby(self.keys.infra, f"given_up:{traj.infra}", 1)
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
            sums = json.loads(cursor.val_role_sums or "{}")
            for role, values in group.role_rewards.items():
                total, count = sums.get(role, [0.0, 0])
                sums[role] = [total + sum(values), count + len(values)]
            cursor.val_role_sums = json.dumps(sums) if sums else ""
            pipe.hset(
                self.keys.scheduler_state,
                mapping={
                    "val_sum": str(cursor.val_sum),
                    "val_count": str(cursor.val_count),
                    "val_role_sums": cursor.val_role_sums,
                },
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
            for role, values in group.role_rewards.items():
                role_point = schemas.RewardPoint(
                    run=self.keys.run,
                    version=group.role_versions.get(role, group.version),
                    mode="train",
                    mean=sum(values) / len(values),
                    count=len(values),
                    group_id=group.group_id,
                    role=role,
                )
                report.reward(pipe, self.keys, role_point)

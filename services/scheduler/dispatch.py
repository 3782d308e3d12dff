"""Dispatch: groups become tasks, committed with their ledger moves in one MULTI/EXEC.

A commit is the XADD of every task, the ledger's `dispatch` move (new -> pending) of each
attempt, the group records and the cursor, all in one transaction: a crash before EXEC leaves
nothing, after it everything, so no task goes out twice or is lost.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import redis

from squall.shared import durability, resources, schemas
from squall.shared.config import SchedulerSection
from squall.shared.keys import Keys
from squall.shared.ledger import Ledger

from .cursor import Cursor
from .dataset import Sample
from .groups import Group


def group_id_for(cursor: Cursor, mode: str) -> str:
    """`g<seq>` for a training group, `v<round>-<seq>` for a validation one."""
    if mode == "train":
        return f"g{cursor.group_seq:07d}"
    return f"v{cursor.val_round:04d}-{cursor.group_seq:07d}"


def new_group(cursor: Cursor, sample: Sample, mode: str, size: int, version: int) -> Group:
    """A fresh group of `size` first attempts of `sample`; takes the next id from `cursor`."""
    group_id = group_id_for(cursor, mode)
    cursor.group_seq += 1
    return Group(
        group_id=group_id,
        sample_id=sample.sample_id,
        mode=mode,
        version=version,
        size=size,
        epoch=cursor.epoch if mode == "train" else -1,
        created=time.time(),
        payload=sample.row,
        attempts=[0] * size,
        done=[False] * size,
        rewards=[None] * size,
    )


class Dispatcher:
    """Builds the tasks of a group's members and queues or commits them."""

    def __init__(
        self,
        r: redis.Redis,
        keys: Keys,
        ledger: Ledger,
        section: SchedulerSection,
        *,
        waitaof_ms: int = 0,
        log: Any = None,
    ) -> None:
        self.r, self.keys, self.ledger, self.section = r, keys, ledger, section
        self.waitaof_ms, self.log = waitaof_ms, log  # waitaof_ms > 0: each commit waits for its fsync

    def tasks_for(
        self, group: Group, members: Iterable[int], version: int, not_before: float = 0.0
    ) -> list[schemas.Task]:
        """The current attempt of each of `members` as a Task, due `task_timeout_s` after it may
        start (now, or `not_before`: an infrastructure retry's backoff); with `attempt_timeout_s`
        the attempt's own clock starts when a runner starts it (Task.run_timeout_s)."""
        now = time.time()
        return [
            schemas.Task(
                run=self.keys.run,
                task_id=f"{group.group_id}:{i}",
                group_id=group.group_id,
                sample_id=group.sample_id,
                index=i,
                group_size=group.size,
                attempt=group.attempts[i],
                mode=group.mode,  # type: ignore[arg-type]
                payload=group.payload,
                min_version=version,
                deadline=max(now, not_before) + self.section.task_timeout_s,
                epoch=group.epoch,
                created_at=now,
                not_before=not_before,
                resources={name: pin[0] for name, pin in group.resources.items()},
                run_timeout_s=self.section.attempt_timeout_s,
            )
            for i in members
        ]

    def queue(
        self,
        pipe: redis.client.Pipeline,
        group: Group,
        members: Iterable[int],
        version: int,
        not_before: float = 0.0,
    ) -> list[str]:
        """Queue the XADD and the `dispatch` move of `members`' current attempts; their keys."""
        tasks = self.tasks_for(group, members, version, not_before)
        for task in tasks:
            pipe.xadd(self.keys.tasks, {schemas.ENTRY_FIELD: schemas.encode(task)})
        keys = [task.key for task in tasks]
        self.ledger.apply("dispatch", keys, pipe=pipe)
        return keys

    def commit(self, groups: list[Group], cursor: Cursor, version: int) -> None:
        """Every member's first task, the ledger moves, group records and cursor: one MULTI/EXEC."""
        pins = resources.current_pins(self.r, self.keys)
        pipe = self.r.pipeline(transaction=True)
        for group in groups:
            if not group.resources:  # a new group pins what is current now (shared/resources.py)
                group.resources = {name: list(pin) for name, pin in pins.items()}
            self.queue(pipe, group, range(group.size), version)
            pipe.hset(self.keys.groups, group.group_id, group.to_json())
        pipe.hset(self.keys.scheduler_state, mapping=cursor.fields())
        pipe.execute()
        if self.waitaof_ms:  # runners may act on these tasks at once: not lost to a host crash
            durability.waitaof(self.r, self.waitaof_ms, self.log, "scheduler_dispatch")

"""Assemble GRPO groups from the trajectory stream.

A group (the n attempts of one sample) is complete when every member index has a final
attempt - an ok one, or a failed one with no retry left - or when ``group_wait_s`` passed
since its first member arrived. Members arriving for a group that is already complete are
*late*: counted, never trained. Validation attempts never enter a group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from squall.shared.schemas import Trajectory


@dataclass
class Member:
    entry_id: str  # stream entry id, acked once the checkpoint covering it is durable
    trajectory: Trajectory


@dataclass
class OpenGroup:
    group_id: str
    size: int
    first_seen: float  # monotonic time of the first member
    members: dict[str, Member] = field(default_factory=dict)  # key -> member
    final_indices: set[int] = field(default_factory=set)  # indices with a final attempt

    @property
    def complete(self) -> bool:
        return len(self.final_indices) >= self.size


@dataclass
class CompleteGroup:
    group_id: str
    members: list[Member]
    timed_out: bool  # completed by the deadline, some member never arrived


class GroupAssembler:
    """Open groups in arrival order; `pop_complete` hands back those that are done."""

    def __init__(self, *, group_wait_s: float, max_attempts: int, done_groups: Iterable[str] = ()) -> None:
        self.group_wait_s, self.max_attempts = group_wait_s, max_attempts
        self.open: dict[str, OpenGroup] = {}
        self.done_groups: set[str] = set(done_groups)  # completed here or in a checkpoint

    def add(self, entry_id: str, trajectory: Trajectory, now: float | None = None) -> str:
        """File one train-mode trajectory; returns 'added', 'late' or 'duplicate'."""
        if trajectory.group_id in self.done_groups:
            return "late"
        now = time.monotonic() if now is None else now
        group = self.open.get(trajectory.group_id)
        if group is None:
            group = self.open[trajectory.group_id] = OpenGroup(
                trajectory.group_id, trajectory.group_size, now
            )
        if trajectory.key in group.members:
            return "duplicate"
        group.members[trajectory.key] = Member(entry_id, trajectory)
        final = trajectory.status == "ok" or trajectory.attempt + 1 >= self.max_attempts
        if final:
            group.final_indices.add(trajectory.index)
        return "added"

    def pop_complete(self, now: float | None = None) -> list[CompleteGroup]:
        """Groups complete by membership or by deadline, oldest first; they become done."""
        now = time.monotonic() if now is None else now
        out = []
        for group_id, group in list(self.open.items()):
            timed_out = now - group.first_seen >= self.group_wait_s
            if group.complete or timed_out:
                del self.open[group_id]
                self.done_groups.add(group_id)
                out.append(
                    CompleteGroup(group_id, list(group.members.values()), timed_out and not group.complete)
                )
        return out

    def next_deadline_s(self, now: float | None = None) -> float | None:
        """Seconds until the oldest open group times out (None when none is open)."""
        if not self.open:
            return None
        now = time.monotonic() if now is None else now
        oldest = min(g.first_seen for g in self.open.values())
        return max(0.0, oldest + self.group_wait_s - now)

"""The open groups: who is in each and which attempt of each member is current (hash `groups`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import redis

from squall.shared.keys import Keys


@dataclass
class Group:
    """An open group: who is in it and which attempt of each member is current."""

    group_id: str
    sample_id: str
    mode: str  # train | val
    version: int  # trainer version when it was dispatched
    size: int
    epoch: int
    created: float
    payload: dict[str, Any]
    attempts: list[int] = field(default_factory=list)  # current attempt per member
    done: list[bool] = field(default_factory=list)  # member settled (ok or dead-lettered)
    rewards: list[float | None] = field(default_factory=list)  # reward of each ok member
    rolled_out: bool = False  # every member settled; held until the trainer consumed it
    infra: list[int] = field(default_factory=list)  # free infrastructure retries per member (empty: none yet)
    infra_since: float = 0.0  # unix time of the group's first infrastructure failure (0: none)
    role_versions: dict[str, int] = field(
        default_factory=dict
    )  # each trained role's version at dispatch ([roles] runs)
    role_rewards: dict[str, list[float]] = field(
        default_factory=dict
    )  # role -> its rewards of the ok members
    # resource name -> [version, generation] pinned at dispatch (shared/resources.py); retries keep it
    resources: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Group:
        return cls(**json.loads(raw))

    @property
    def complete(self) -> bool:
        return all(self.done)

    def attempt_key(self, index: int) -> str:
        """The ledger key of member `index`'s current attempt (as `Task.key` spells it)."""
        return f"{self.group_id}:{index}#{self.attempts[index]}"

    def infra_retries(self, index: int) -> int:
        """Retries of member `index` that failed for the infrastructure and were not charged."""
        return self.infra[index] if self.infra else 0

    def ok_rewards(self) -> list[float]:
        return [x for x in self.rewards if x is not None]


def load_groups(r: redis.Redis, keys: Keys) -> dict[str, Group]:
    raw: dict[bytes, bytes] = r.hgetall(keys.groups)  # type: ignore[assignment]
    return {k.decode(): Group.from_json(v) for k, v in raw.items()}


def trained(r: redis.Redis, keys: Keys, held: list[Group]) -> list[Group]:
    """The held groups the trainer has consumed: none of their current attempts is still `ok`."""
    if not held:
        return []
    pipe = r.pipeline(transaction=False)
    for group in held:
        for i in range(group.size):  # HGETs, not HMGET: the ACL grants HGET on the ledger
            pipe.hget(keys.attempts, group.attempt_key(i))
    states = iter(pipe.execute())
    return [g for g in held if b"ok" not in [next(states) for _ in range(g.size)]]

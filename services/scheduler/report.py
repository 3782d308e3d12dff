"""What the scheduler writes for people and dashboards: lifecycle events and reward points."""

from __future__ import annotations

from typing import Any

import redis

from squall.shared import bus, schemas
from squall.shared.keys import EVENTS_MAXLEN, METRICS_MAXLEN, Keys


def event(r: redis.Redis, keys: Keys, name: str, **fields: Any) -> None:
    """One Event (service `scheduler`) on the `events` stream."""
    message = schemas.Event(run=keys.run, service="scheduler", name=name, fields=fields)
    bus.publish(r, keys.events, message, maxlen=EVENTS_MAXLEN)


def reward(client: redis.Redis | redis.client.Pipeline, keys: Keys, point: schemas.RewardPoint) -> None:
    """One point of the reward curve on `rewards` (capped like the metrics); `client` may be a
    caller's MULTI/EXEC, so a train group's point lands with its last outcome."""
    client.xadd(
        keys.rewards, {schemas.ENTRY_FIELD: schemas.encode(point)}, maxlen=METRICS_MAXLEN, approximate=True
    )

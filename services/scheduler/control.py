"""Control: operators' pause / resume / drain / limits, read from the `control` stream.

The scheduler reads `control` without a group (every entry once, from the cursor's
`control_id`); an applied entry and the changed settings are saved with the cursor, so a
restart neither misses nor repeats one. A malformed entry is dead-lettered and skipped.
"""

from __future__ import annotations

import redis

from squall.shared import bus, schemas
from squall.shared.keys import Keys

from . import report
from .cursor import Cursor

READ_COUNT = 100  # control entries read per step


def apply_action(cursor: Cursor, control: schemas.Control) -> None:
    """Change the cursor's settings as `control` says (no I/O)."""
    if control.action == "pause":
        cursor.paused = 1
    elif control.action == "resume":
        cursor.paused, cursor.draining = 0, 0
    elif control.action == "drain":
        cursor.draining = 1
    elif control.action == "limits":
        if "max_inflight_groups" in control.limits:
            cursor.max_inflight_groups = max(1, int(control.limits["max_inflight_groups"]))
        for name in ("max_dispatch_lag", "max_staleness"):  # the config's name, and its old one
            if name in control.limits:
                cursor.max_staleness = max(0, int(control.limits[name]))


def apply_control(r: redis.Redis, keys: Keys, cursor: Cursor, log) -> int:
    """Apply every new Control entry to `cursor` and save it; returns how many were read."""
    reply = r.xread({keys.control: cursor.control_id}, count=READ_COUNT)
    read = 0
    for _, entries in reply or []:
        for raw_id, fields in entries:
            entry_id, read = raw_id.decode(), read + 1
            message = _decode(r, keys, entry_id, fields)
            if message is not None:
                apply_action(cursor, message)
                report.event(r, keys, "control", action=message.action, limits=message.limits)
                log.info("control_applied", action=message.action, limits=message.limits)
            cursor.control_id = entry_id
            r.hset(keys.scheduler_state, mapping=cursor.fields())
    return read


def _decode(r: redis.Redis, keys: Keys, entry_id: str, fields: dict) -> schemas.Control | None:
    raw = fields.get(schemas.ENTRY_FIELD, b"")
    try:
        return schemas.decode(raw, schemas.Control)
    except Exception as exc:  # a malformed entry: recorded, then skipped
        bus.dead_letter(r, keys.deadletter, source=keys.control, entry_id=entry_id, reason=str(exc), raw=raw)
        return None

"""Stream primitives on Redis Streams: publish, consume through a group, ack, lease
renewal, reclaim, dead-letter and safe trimming.

At-least-once delivery comes from Redis; exactly-once *effect* is built above this by keying
work on (task_id, attempt). Here:
- an entry is one field ``m`` holding one encoded message (shared.schemas);
- an entry that fails to decode is dead-lettered with the reason and its original bytes, and
  acked, so a consumer never sees it again and never stops on it;
- a consumer's pending entry is its lease: renewing resets the entry's idle time, and an
  entry idle longer than the lease is reclaimed by another consumer (XAUTOCLAIM);
- trimming never removes an entry some group has not acknowledged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from . import schemas
from .errors import SchemaError
from .keys import DEADLETTER_MAXLEN

# Renew only entries this consumer still owns: a plain XCLAIM would steal back an entry
# that another consumer already reclaimed after our lease lapsed.
_RENEW_SCRIPT = """
-- KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. The consumer is an
-- argument, not a key: ACL key patterns (and Redis Cluster) check every KEYS entry.
local owned = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
    table.insert(owned, id)
  end
end
return owned
"""


@dataclass(frozen=True)
class Delivery:
    """One decoded entry handed to a consumer."""

    entry_id: str  # stream entry id, needed to ack or renew
    message: Any  # the decoded, validated message
    deliveries: int = 1  # how many times the group delivered it (>1: a reclaim)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def publish(r: redis.Redis, stream: str, message: schemas.Message, *, maxlen: int | None = None) -> str:
    """XADD one message; returns its entry id."""
    entry_id = r.xadd(stream, {schemas.ENTRY_FIELD: schemas.encode(message)}, maxlen=maxlen, approximate=True)
    return _text(entry_id)


def publish_many(
    r: redis.Redis, stream: str, messages: Iterable[schemas.Message], *, maxlen: int | None = None
) -> list[str]:
    """XADD many messages in one round trip (a non-transactional pipeline)."""
    pipe = r.pipeline(transaction=False)
    for message in messages:
        pipe.xadd(stream, {schemas.ENTRY_FIELD: schemas.encode(message)}, maxlen=maxlen, approximate=True)
    return [_text(entry_id) for entry_id in pipe.execute()]


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Create `group` on `stream` (and the stream) unless it exists."""
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def dead_letter(
    r: redis.Redis,
    deadletter_stream: str,
    *,
    source: str,
    entry_id: str,
    reason: str,
    raw: bytes | None,
    group: str = "",
    pipe: redis.client.Pipeline | None = None,
) -> str | None:
    """Record an entry that could not be processed: where from, why, and its original bytes.

    Returns the dead-letter entry's id, or None when queued on `pipe` (a caller's MULTI/EXEC).
    """
    fields: dict[Any, Any] = {"source": source, "id": entry_id, "group": group, "reason": reason[:2000]}
    fields["raw"] = raw if raw is not None else b""
    if pipe is not None:
        pipe.xadd(deadletter_stream, fields, maxlen=DEADLETTER_MAXLEN, approximate=True)
        return None
    return _text(r.xadd(deadletter_stream, fields, maxlen=DEADLETTER_MAXLEN, approximate=True))


class GroupConsumer:
    """One named consumer of one group on one stream, decoding entries as `kind`.

    Malformed entries never reach the caller: they are dead-lettered and acked here.
    """

    def __init__(
        self,
        r: redis.Redis,
        stream: str,
        group: str,
        consumer: str,
        *,
        kind: type[schemas.Message] | None,
        deadletter_stream: str,
        start_id: str = "0",
    ) -> None:
        self.r, self.stream, self.group, self.consumer = r, stream, group, consumer
        self.kind, self.deadletter_stream = kind, deadletter_stream
        self.dead_lettered = 0  # count of malformed entries this consumer dead-lettered
        ensure_group(r, stream, group, start_id)
        self._renew = r.register_script(_RENEW_SCRIPT)

    def read(self, count: int, block_ms: int | None = None, *, own_pending: bool = False) -> list[Delivery]:
        """New entries for this consumer (blocking up to `block_ms`, never forever).

        With `own_pending`, re-read the entries already delivered to this consumer name and
        not acked (a restarted process with a stable name resumes its work).
        """
        start = "0" if own_pending else ">"
        block = None if own_pending else block_ms
        # RESP2 reply: [[stream, [(id, fields), ...]]] (redis-py types it for RESP3 too).
        reply: Any = self.r.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=count, block=block
        )
        entries = reply[0][1] if reply else []
        return self._decode_all(entries, deliveries=None)

    def ack(self, entry_ids: Sequence[str]) -> int:
        return int(self.r.xack(self.stream, self.group, *entry_ids)) if entry_ids else 0

    def renew(self, entry_ids: Sequence[str]) -> list[str]:
        """Reset the idle time of entries this consumer still owns; returns those ids.

        An id missing from the result was reclaimed by another consumer: stop working on it.
        """
        if not entry_ids:
            return []
        owned = self._renew(keys=[self.stream], args=[self.group, self.consumer, *entry_ids])
        return [_text(entry_id) for entry_id in owned]

    def reclaim(self, min_idle_ms: int, count: int = 100) -> list[Delivery]:
        """Take over entries other consumers left idle for `min_idle_ms` (their lease lapsed)."""
        reply = self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_ms, "0-0", count=count)
        entries = [entry for entry in reply[1] if entry[1] is not None]
        # XAUTOCLAIM drops entries deleted from the stream; their PEL records are gone too.
        return self._decode_all(entries, deliveries=self._delivery_counts([_text(e[0]) for e in entries]))

    def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        if not entry_ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        counts = {}
        for entry_id, rows in zip(entry_ids, pipe.execute(), strict=True):
            counts[entry_id] = int(rows[0]["times_delivered"]) if rows else 1
        return counts

    def _decode_all(self, entries: list, deliveries: dict[str, int] | None) -> list[Delivery]:
        out: list[Delivery] = []
        for raw_id, fields in entries:
            entry_id = _text(raw_id)
            raw = fields.get(schemas.ENTRY_FIELD) if fields else None
            try:
                if raw is None:
                    raise SchemaError(f"entry has no '{schemas.ENTRY_FIELD.decode()}' field")
                message = schemas.decode(raw, self.kind)
            except SchemaError as exc:
                self._reject(entry_id, str(exc), raw if raw is not None else _flatten(fields))
                continue
            out.append(Delivery(entry_id, message, (deliveries or {}).get(entry_id, 1)))
        return out

    def _reject(self, entry_id: str, reason: str, raw: bytes) -> None:
        dead_letter(
            self.r,
            self.deadletter_stream,
            source=self.stream,
            entry_id=entry_id,
            reason=reason,
            raw=raw,
            group=self.group,
        )
        self.ack([entry_id])
        self.dead_lettered += 1


def _flatten(fields: dict | None) -> bytes:
    """Original bytes of an entry without our field, kept for the dead-letter record."""
    import msgspec

    if not fields:
        return b""
    return msgspec.msgpack.encode({_text(k): v for k, v in fields.items()})


def _next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def acked_boundary(r: redis.Redis, stream: str, groups: Sequence[str]) -> str | None:
    """The smallest entry id some group still needs; every entry below it is acked by all.

    None when a required group is missing (nobody may trim yet) or nothing is safe.
    """
    try:
        infos = {_text(info["name"]): info for info in r.xinfo_groups(stream)}
    except redis.ResponseError:
        return None
    boundary: str | None = None
    for group in groups:
        info = infos.get(group)
        if info is None:
            return None
        if int(info["pending"]):
            summary = r.xpending(stream, group)
            needed = _text(summary["min"])
        else:
            needed = _next_id(_text(info["last-delivered-id"]))
        if boundary is None or _id_tuple(needed) < _id_tuple(boundary):
            boundary = needed
    return boundary


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def trim_acknowledged(r: redis.Redis, stream: str, groups: Sequence[str]) -> int:
    """Remove entries every one of `groups` has acknowledged; returns how many went."""
    boundary = acked_boundary(r, stream, groups)
    if boundary is None or not groups:
        return 0
    return int(r.xtrim(stream, minid=boundary, approximate=False))

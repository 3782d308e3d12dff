"""Reading the `weights` stream: one rule for every reader.

The stream is written only by the trainer (its ACL user is the only one allowed to append),
but a reader never trusts that: an entry that does not decode as a WeightVersion is logged
(`weights_entry_invalid`, with its entry id), counted and skipped, and the reader goes on with
the entries around it. `newest_valid` is what a reader that needs "the version published last"
calls: it walks back from the newest entry, page by page, past malformed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from . import schemas
from .errors import SchemaError

SCAN_PAGE = 32  # entries per XREVRANGE while looking back for the newest valid one

log = structlog.get_logger()


@dataclass
class NewestWeights:
    """What a look back from the newest `weights` entry found."""

    last_id: str | None  # the newest entry of any kind (read on after it); None: stream empty
    version: schemas.WeightVersion | None  # the newest entry that decodes; None: no valid one
    skipped: int  # malformed entries passed over on the way back


def entry_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def decode(entry_id: Any, fields: dict[Any, Any], reader: str) -> schemas.WeightVersion | None:
    """The entry's WeightVersion, or None (logged with `reader` and the entry id) when it is not one."""
    raw = fields.get(schemas.ENTRY_FIELD, fields.get(schemas.ENTRY_FIELD.decode()))
    try:
        if raw is None:
            raise SchemaError(f"entry has no {schemas.ENTRY_FIELD!r} field")
        return schemas.decode(raw, schemas.WeightVersion)
    except Exception as exc:  # SchemaError, or anything a foreign writer put there
        log.error("weights_entry_invalid", reader=reader, entry=entry_text(entry_id), error=str(exc)[:300])
        return None


def _scan(found: NewestWeights, page: list[Any], reader: str) -> str | None:
    """Fold one XREVRANGE page into `found`; the id to continue below, None when done."""
    for entry_id, fields in page:
        if found.last_id is None:
            found.last_id = entry_text(entry_id)
        message = decode(entry_id, fields, reader)
        if message is not None:
            found.version = message
            return None
        found.skipped += 1
    if len(page) < SCAN_PAGE:
        return None
    return "(" + entry_text(page[-1][0])


def newest_valid(r: Any, stream: str, reader: str) -> NewestWeights:
    """The newest decodable WeightVersion on `stream` (a synchronous redis client)."""
    found = NewestWeights(None, None, 0)
    upper: str | None = "+"
    while upper is not None:
        upper = _scan(found, r.xrevrange(stream, max=upper, count=SCAN_PAGE), reader)
    return found


async def newest_valid_async(r: Any, stream: str, reader: str) -> NewestWeights:
    """`newest_valid` for a redis.asyncio client."""
    found = NewestWeights(None, None, 0)
    upper: str | None = "+"
    while upper is not None:
        upper = _scan(found, await r.xrevrange(stream, max=upper, count=SCAN_PAGE), reader)
    return found

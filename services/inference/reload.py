"""Hot weight reload: follow the `weights` stream and serve each new version.

Every node reads the whole stream (XREAD, no consumer group: each node must see every
version). On start it loads the newest published version, if any, before serving; then it
blocks on XREAD from that entry. Of a burst of versions only the newest is loaded. A version
is loaded only after its file's sha256 matches the announced checksum; a missing, corrupt or
mismatched file is logged and counted (`squall_inference_weight_errors_total{reason}`) and the
node keeps serving the version it had. On success it XADDs WeightApplied to
`weights:applied` and sets `versions[inference:<node>]`. It also writes the node's heartbeat.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import redis
import structlog

from squall.shared import schemas
from squall.shared.errors import SchemaError, WeightsError
from squall.shared.keys import Keys
from squall.shared.weightfiles import sha256_file

from .engine import Engine
from .metrics import InferenceMetrics

BLOCK_MS = 2000  # longest XREAD wait; also the heartbeat interval
RETRY_MIN_S, RETRY_MAX_S = 0.5, 5.0  # backoff between reads while Redis does not answer

log = structlog.get_logger()


class WeightFollower:
    """Keeps one node's engine on the newest good weight version."""

    def __init__(
        self, r: Any, keys: Keys, engine: Engine, *, node: str, url: str, metrics: InferenceMetrics
    ) -> None:
        self.r, self.keys, self.engine = r, keys, engine  # r: a redis.asyncio client
        self.node, self.url, self.metrics = node, url, metrics
        self.last_id = "0-0"  # the stream entry read last
        self._stopping = False

    async def catch_up(self) -> None:
        """Load the newest published version, if any; later reads start after it."""
        newest = await self.r.xrevrange(self.keys.weights, count=1)
        if newest:
            entry_id, fields = newest[0]
            self.last_id = _text(entry_id)
            message = self._decode(self.last_id, fields)
            if message is not None:
                await self.apply(message)
        await self.heartbeat()

    async def run(self) -> None:
        backoff = RETRY_MIN_S
        while not self._stopping:
            try:
                await self._follow_once()
                backoff = RETRY_MIN_S
            except (redis.ConnectionError, redis.TimeoutError) as exc:  # Redis restarts: retry
                self.metrics.redis_errors.inc()
                log.warning(
                    "weights_follow_retry",
                    error=str(exc),
                    retry_in_s=backoff,
                    serving=self.engine.weight_version,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)

    async def _follow_once(self) -> None:
        reply = await self.r.xread({self.keys.weights: self.last_id}, count=64, block=BLOCK_MS)
        await self.heartbeat()
        if not reply:
            return
        newest = None
        for entry_id, fields in reply[0][1]:
            self.last_id = _text(entry_id)
            message = self._decode(self.last_id, fields)
            if message is not None and (newest is None or message.version > newest.version):
                newest = message
        if newest is not None:
            await self.apply(newest)

    def stop(self) -> None:
        self._stopping = True

    def _decode(self, entry_id: str, fields: dict) -> schemas.WeightVersion | None:
        try:
            raw = fields.get(schemas.ENTRY_FIELD)
            if raw is None:
                raise SchemaError("entry has no 'm' field")
            return schemas.decode(raw, schemas.WeightVersion)
        except SchemaError as exc:
            self.metrics.weight_errors.labels("message").inc()
            log.error("weights_message_invalid", entry=entry_id, error=str(exc))
            return None

    async def apply(self, message: schemas.WeightVersion) -> bool:
        """Verify and load one version; False (old version kept) when it cannot be used."""
        current = self.engine.weight_version
        if message.version < current:
            log.info("weights_skipped", version=message.version, serving=current)
            return False
        if message.version == current:
            # Already serving it (e.g. version 0 is the model we started with): still say so,
            # or the trainer would keep old files forever and status would show no version.
            await self._acknowledge(
                schemas.WeightApplied(run=self.keys.run, node=self.node, version=current, load_s=0.0)
            )
            return False
        start = time.monotonic()
        try:
            await asyncio.to_thread(self._verify, message)
            await self.engine.apply_weights(message.version, message.location)
        except WeightsError as exc:
            reason = str(exc).split(":", 1)[0]
            self.metrics.weight_errors.labels(reason).inc()
            log.error(
                "weights_rejected", version=message.version, serving=current, reason=reason, error=str(exc)
            )
            return False
        load_s = time.monotonic() - start
        applied = schemas.WeightApplied(
            run=self.keys.run, node=self.node, version=message.version, load_s=load_s
        )
        await self._acknowledge(applied)
        self.metrics.weight_reloads.inc()
        self.metrics.reload_seconds.observe(load_s)
        self.metrics.weight_version.set(message.version)
        self.metrics.served_version.set(message.version)
        log.info(
            "weights_applied",
            version=message.version,
            step=message.step,
            previous=current,
            load_s=round(load_s, 3),
        )
        return True

    async def _acknowledge(self, applied: schemas.WeightApplied) -> None:
        """XADD WeightApplied and set our versions field; retried while Redis is away, since
        the stream entry that announced the version will not be read again."""
        backoff = RETRY_MIN_S
        while True:
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.xadd(self.keys.weights_applied, {schemas.ENTRY_FIELD: schemas.encode(applied)})
                pipe.hset(self.keys.versions, f"inference:{self.node}", applied.version)
                await pipe.execute()
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._stopping:
                    raise
                self.metrics.redis_errors.inc()
                log.warning("weights_ack_retry", version=applied.version, error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)

    @staticmethod
    def _verify(message: schemas.WeightVersion) -> None:
        """Raise WeightsError whose text starts with the reason: missing, format, checksum."""
        if message.format != "safetensors":
            raise WeightsError(
                f"format: version {message.version} is {message.format!r}; only safetensors loads"
            )
        path = Path(message.location)
        if not path.is_file():
            raise WeightsError(f"missing: version {message.version} file {path} does not exist")
        actual = sha256_file(path)
        if actual != message.checksum.lower():
            raise WeightsError(
                f"checksum: version {message.version} file {path} has sha256 {actual}, announced {message.checksum}"
            )

    async def heartbeat(self) -> None:
        beat = {
            "time": time.time(),
            "version": self.engine.weight_version,
            "url": self.url,
            **self.engine.stats(),
        }
        await self.r.hset(self.keys.heartbeats, f"inference:{self.node}", json.dumps(beat))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""Hot weight reload: follow the `weights` stream and serve each role's new versions.

Every node reads the whole stream (XREAD, no consumer group: each node must see every
version). Each version names its role (WeightVersion.role; `policy` in a single-policy run)
and the follower treats the roles apart: on start it loads each role's newest published
version, if any, before serving; then it blocks on XREAD from the last entry. Of a burst only
each role's newest is loaded. Every announced version is also told to the engine's catalog
(weights/catalog.py), so a request may still name an older one by `role@version`. A version
is loaded only after its file's sha256 (a sharded version: its index's, then each shard's
against the index) matches the announced checksum; a missing, corrupt or mismatched file is
logged and counted (`squall_inference_weight_errors_total{reason}`) and the node keeps
serving the version it had. A LoRA version (format "lora") is an adapter the engine applies
to the base model it started with (`Engine.apply_adapter`, with the role). On success it XADDs
WeightApplied (with the role) to `weights:applied` and sets the role's `versions` field,
`inference:<node>` for `policy`, `inference:<node>:<role>` for the others (shared.roles). It also writes the node's heartbeat
(`inference:<node>`, through shared.heartbeat). While Redis does not answer, the node keeps
serving and its reads and acknowledgements wait for Redis (shared.retry's one policy: logged,
counted in `squall_inference_redis_errors_total`); past `run.redis_outage_s` the follower
raises RedisUnavailable and the node stops.

A snapshot node (`inference.pin_version` K, or `inference.behind_versions` N) serves an older
policy, e.g. an opponent for self-play, without a second model file: it remembers every
version the stream announced, per role (`Snapshot.target` picks K, or the newest minus N, for
each role) and loads only that one. A pinned node acknowledges in `versions` as
`snapshot:<node>` (`snapshot:<node>:<role>` for roles other than policy), which keeps version
K's file from being pruned without holding back the pruning of newer ones; a trailing node
acknowledges as `inference:<node>` like any follower, so the versions it will move to next stay
on disk. A pin on a version never published, or whose file is gone, stops the node at start
with an error naming `inference.pin_version`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import structlog

from squall.inference.engines.engine import Engine
from squall.inference.node_metrics import InferenceMetrics
from squall.shared import schemas, weightstream
from squall.shared.adapterfiles import FORMAT_LORA, verify_adapter
from squall.shared.errors import ConfigError, WeightsError
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import WEIGHTS_APPLIED_MAXLEN, Keys
from squall.shared.retry import REDIS_ERRORS, RedisOutage
from squall.shared.roles import DEFAULT_ROLE, node_field
from squall.shared.weightfiles import FORMAT_FILE, FORMAT_SHARDED, read_index, sha256_file

BLOCK_MS = 2000  # longest XREAD wait; also the heartbeat interval

log = structlog.get_logger()


class Snapshot:
    """Which published version a node serves: the newest (default), exactly `pin`, or the
    newest minus `behind`. Pure: `choose` looks only at the versions it is given."""

    def __init__(self, pin: int = -1, behind: int = 0) -> None:
        self.pin, self.behind = pin, behind

    @property
    def pinned(self) -> bool:
        return self.pin >= 0

    @property
    def following(self) -> bool:
        """A plain follower: the newest version, acknowledged as `inference:<node>`."""
        return not self.pinned and not self.behind

    def target(self, published: list[int]) -> int | None:
        """The version to serve given the published ones (None: nothing to load)."""
        if not published:
            return None
        if self.pinned:
            return self.pin if self.pin in published else None
        wanted = max(published) - self.behind
        older = [v for v in published if v <= wanted]
        return max(older) if older else None  # None: keep the model the node started with


class WeightFollower:
    """Keeps one node's engine on each role's newest good weight version (or its snapshot)."""

    def __init__(
        self,
        r: Any,
        keys: Keys,
        engine: Engine,
        *,
        node: str,
        metrics: InferenceMetrics,
        outage: RedisOutage,
        metrics_port: int = 0,
        snapshot: Snapshot | None = None,
    ) -> None:
        self.r, self.keys, self.engine = r, keys, engine  # r: a redis.asyncio client
        self.node, self.metrics, self.outage, self.metrics_port = node, metrics, outage, metrics_port
        self.snapshot = snapshot or Snapshot()
        self.beats = HeartbeatWriter(r, keys, "inference", node, every_s=BLOCK_MS / 1000)
        self.last_id = "0-0"  # the stream entry read last
        # role -> version -> announcement; a follower needs only the newest, a snapshot node all
        self.published: dict[str, dict[int, schemas.WeightVersion]] = {}
        self._stopping = False
        self.acknowledged: dict[str, int] = {}  # role -> version last written to `versions` by this process

    def serving(self, role: str) -> int:
        """The version of `role` the engine serves to a request for the bare role name."""
        if role == DEFAULT_ROLE:
            return self.engine.weight_version
        return self.engine.served_versions().get(role, 0)

    async def catch_up(self) -> None:
        """Load each role's newest valid published version (a snapshot node: its version of
        each role), if any; later reads start after the last entry. Malformed entries are
        skipped and counted. Whatever was loaded (or not), `versions` then says what the
        engine serves per role, so a restarted node never inherits the version its predecessor
        acknowledged. A pin that cannot be served raises ConfigError."""
        self._remember(await self.r.xrange(self.keys.weights))
        await self._serve_targets(at_start=True)
        for role in {DEFAULT_ROLE, *self.published}:
            if role not in self.acknowledged:  # nothing loaded: the model the node started with
                await self._acknowledge(role, load_s=0.0)
        await self.heartbeat()

    def _remember(self, entries: list) -> set[str]:
        """Note the announced versions per role (and tell the engine's catalog, so older
        versions on disk stay servable by `role@version`), move last_id; returns the roles
        that got a new announcement."""
        roles: set[str] = set()
        for entry_id, fields in entries:
            self.last_id = _text(entry_id)
            message = self._decode(self.last_id, fields)
            if message is None:
                continue
            self.published.setdefault(message.role, {})[message.version] = message
            self.engine.catalog.announce(
                message.role, message.version, message.location, message.checksum, message.format
            )
            roles.add(message.role)
        return roles

    async def _serve_targets(self, *, at_start: bool = False, roles: set[str] | None = None) -> None:
        for role in sorted(self.published if roles is None else roles):
            await self._serve_role(role, at_start=at_start)

    async def _serve_role(self, role: str, *, at_start: bool) -> None:
        published = self.published.get(role, {})
        target = self.snapshot.target(sorted(published))
        pin = self.snapshot.pin
        serving = self.serving(role)
        of_role = "" if role == DEFAULT_ROLE else f" of role {role!r}"  # a single-policy run reads as before
        if target is None and self.snapshot.pinned and not (pin == 0 and serving == 0):
            if at_start:
                known = sorted(published)
                shown = f"{known[0]}..{known[-1]}" if known else "none yet"
                raise ConfigError(
                    f"inference.pin_version: version {pin}{of_role} was never published on "
                    f"{self.keys.weights} (published: {shown}); pin a published version, or trail the "
                    "newest with inference.behind_versions"
                )
            return
        if target is None:
            return  # the initial model (version 0): catch_up acknowledges what the engine serves
        if target == serving and not at_start:
            return
        applied = await self.apply(published[target])
        if at_start and self.snapshot.pinned and not applied and self.serving(role) != pin:
            raise ConfigError(
                f"inference.pin_version: version {pin}{of_role} cannot be loaded (file "
                f"{published[pin].location} missing or corrupt; see the weights_rejected log "
                "line); pin a version still on disk"
            )

    async def run(self) -> None:
        """Follow until stopped; RedisUnavailable when Redis stays away past the outage deadline."""
        while not self._stopping:
            try:
                await self._follow_once()
            except REDIS_ERRORS as exc:  # Redis restarts: wait for it, then read on from last_id
                await self.outage.wait_async(self.r, exc, "weights_follow")

    async def _follow_once(self) -> None:
        reply = await self.r.xread({self.keys.weights: self.last_id}, count=64, block=BLOCK_MS)
        await self.heartbeat()
        if not reply:
            return
        roles = self._remember(reply[0][1])
        if self.snapshot.following:  # of a burst, only each role's newest is loaded
            for role in sorted(roles):
                await self.apply(self.published[role][max(self.published[role])])
        else:
            await self._serve_targets(roles=roles)

    def stop(self) -> None:
        self._stopping = True

    def _decode(self, entry_id: str, fields: dict) -> schemas.WeightVersion | None:
        message = weightstream.decode(entry_id, fields, f"inference:{self.node}")
        if message is None:
            self.metrics.weight_errors.labels("message").inc()
        return message

    async def apply(self, message: schemas.WeightVersion) -> bool:
        """Verify and load one version of its role; False (old version kept) when it cannot be used."""
        role = message.role
        current = self.serving(role)
        if message.version < current:
            log.info("weights_skipped", role=role, version=message.version, serving=current)
            return False
        if message.version == current:
            # Already serving it (e.g. version 0 is the model we started with): still say so,
            # or the trainer would keep old files forever and status would show no version.
            await self._acknowledge(role, load_s=0.0)
            return False
        start = time.monotonic()
        try:
            await asyncio.to_thread(self._verify, message)
            if message.format == FORMAT_LORA:
                if role == DEFAULT_ROLE:  # the single-policy call, as before roles existed
                    await self.engine.apply_adapter(message.version, message.location)
                else:
                    await self.engine.apply_adapter(message.version, message.location, role)
            elif role != DEFAULT_ROLE:
                raise WeightsError(
                    f"format: version {message.version} of role {role!r} is {message.format!r}; a role "
                    "other than policy is served as a LoRA adapter on the shared base"
                )
            else:
                await self.engine.apply_weights(message.version, message.location)
        except WeightsError as exc:
            reason = str(exc).split(":", 1)[0]
            self.metrics.weight_errors.labels(reason).inc()
            log.error(
                "weights_rejected",
                role=role,
                version=message.version,
                serving=current,
                reason=reason,
                error=str(exc),
            )
            if self.acknowledged.get(role) != self.serving(role):  # still the old one: make sure it is said
                await self._acknowledge(role, load_s=0.0)
            return False
        load_s = time.monotonic() - start
        await self._acknowledge(role, load_s=load_s)
        self.metrics.weight_reloads.inc()
        self.metrics.reload_seconds.observe(load_s)
        if role == DEFAULT_ROLE:
            self.metrics.weight_version.set(message.version)
            self.metrics.served_version.set(message.version)
        log.info(
            "weights_applied",
            role=role,
            version=message.version,
            step=message.step,
            previous=current,
            load_s=round(load_s, 3),
        )
        return True

    async def _acknowledge(self, role: str, *, load_s: float) -> None:
        """XADD WeightApplied and set the role's versions field to the version the engine
        serves now (for `policy`, the one value /health reports too): the only writer of this
        node's fields, called on start and after every load, successful or not. Repeated after
        an outage, since the stream entry that announced the version will not be read again."""
        applied = schemas.WeightApplied(
            run=self.keys.run, node=self.node, version=self.serving(role), load_s=load_s, role=role
        )
        prefix = "snapshot" if self.snapshot.pinned else "inference"
        field = prefix + node_field(self.node, role).removeprefix("inference")
        while True:
            try:
                pipe = self.r.pipeline(transaction=False)
                pipe.xadd(
                    self.keys.weights_applied,
                    {schemas.ENTRY_FIELD: schemas.encode(applied)},
                    maxlen=WEIGHTS_APPLIED_MAXLEN,
                    approximate=True,
                )
                pipe.hset(self.keys.versions, field, applied.version)
                await pipe.execute()
                self.acknowledged[role] = applied.version
                return
            except REDIS_ERRORS as exc:
                if self._stopping:
                    raise
                await self.outage.wait_async(self.r, exc, "weights_ack")

    @staticmethod
    def _verify(message: schemas.WeightVersion) -> None:
        """Raise WeightsError whose text starts with the reason: missing, format, checksum.
        A sharded version: its index against the announced checksum here; each shard against
        the index as the engine reads it (shardload.py). A LoRA adapter: both files against
        the announced manifest checksum (shared.adapterfiles)."""
        if message.format == FORMAT_LORA:
            verify_adapter(message.location, message.checksum)
            return
        if message.format == FORMAT_SHARDED:
            read_index(message.location, message.checksum)
            return
        if message.format != FORMAT_FILE:
            raise WeightsError(
                f"format: version {message.version} is {message.format!r}; "
                f"known formats: {FORMAT_SHARDED}, {FORMAT_FILE}, {FORMAT_LORA}"
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
        """`inference:<node>`: the version served, where /metrics listens, the engine's counts, and
        `follows_newest` (1: a plain follower; the scheduler's end round waits for those)."""
        await self.beats.beat_async(
            version=self.engine.weight_version,
            metrics_port=self.metrics_port,
            follows_newest=float(self.snapshot.following),
            **self.engine.stats(),
        )


_text = weightstream.entry_text

"""The trainer loop: trajectories -> groups -> filtered, advantaged samples -> one optimizer
step -> durable checkpoint -> ledger + acks -> weights published -> metrics.

Parts (one module each, wired here and nowhere else):
- bookkeeping.Bookkeeping   exactly-once: where every entry read is (open group, waiting for
                            a step, next commit, durable); the reason -> ledger move mapping
- groups.GroupAssembler     complete groups from the stream (deadline, late members)
- filters.decide_group      failed / zero-variance / stale / overlong members, advantages
- caps                      per-run transition caps (turn tokens, turns per trajectory)
- advantages                GRPO, Dr.GRPO, RLOO (one scalar per trajectory); turn_* (one per
                            turn, from turn-level rewards)
- sft                       SFT from the run's own successful trajectories (trainer.sft)
- distill                   on-policy distillation: a teacher endpoint's logprobs become the
                            per-token advantage (trainer.distill_url)
- sequences                 turns -> merged, masked samples; padding and micro-batches
- backend (torch | verl)    the model, the loss (losses.py) and the optimizer
- checkpoint.CheckpointStore model + optimizer + RNG + this commit's done delta, write-then-
                            rename; the done log (every commit's delta) for the whole set
- publish.Publisher         safetensors + WeightVersion, pruning acknowledged versions
- ops.health                /health, /ready (model loaded, not stopping), /metrics: the
                            standard squall metrics (step, version, trained tokens, tokens/s)
- distributed               with several ranks: rank 0 runs this Trainer, the others
                            `follow` it (each backend call rank 0 makes, they make too)
Exactly-once: an entry is acked only after the checkpoint listing its key is durable; on
resume the consumer re-reads its own pending entries and skips keys in the done set.
Redis outage: the loop's unit of work is retried after `RedisOutage.wait`, recovering as a
restart does (without reloading the model); past run.redis_outage_s, RedisUnavailable.
SIGTERM: the current step finishes, is checkpointed, and the process exits 0 (a SIGTERM
while the model is still loading stops it right after loading, before any work).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from prometheus_client import REGISTRY

from squall.monitor.metrics import standard_metrics
from squall.shared import bus, dataend, durability, schemas
from squall.shared.config import RunConfig
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import EVENTS_MAXLEN, METRICS_MAXLEN, Keys, trainer_group
from squall.shared.ledger import FilterReason, Ledger
from squall.shared.logs import get_logger
from squall.shared.redisconn import connect
from squall.shared.retry import REDIS_ERRORS, RedisOutage
from squall.shared.roles import DEFAULT_ROLE, trainer_field
from squall.tracking.otel import tracer_for

from . import distill, distributed, sft
from .backend import TrainerBackend, make_backend
from .bookkeeping import Bookkeeping, Sealed, Seen, ledger_moves
from .cadence import CheckpointCadence, resume_version
from .caps import TurnCaps
from .checkpoint import CheckpointStore, DoneDelta, TrainerState
from .filters import GroupDecision, decide_group
from .group_assembly import CompleteGroup
from .publish import Publisher
from .sequences import OutOfVocab, Sample, SplitStats, check_vocab, trajectory_to_samples

READ_COUNT = 256  # entries per XREADGROUP
READ_BLOCK_MS = 500  # longest blocking read: SIGTERM and group deadlines are checked this often
PENDING_REPLAY_COUNT = 1_000_000  # own pending entries re-read at start (all of them)
HEARTBEAT_S = 5.0
TRAINED_LOG = "trained.jsonl"  # one line per durable step: {"step", "version", "keys"}


class Trainer:
    def __init__(
        self,
        config: RunConfig,
        backend: str | TrainerBackend | None = None,
        leader: distributed.Leader | None = None,
        *,
        role: str = DEFAULT_ROLE,
    ) -> None:
        self.config, self.cfg = config, config.trainer
        # One trained role (multirole.py runs one Trainer per role, each with its own group).
        self.role, self.group = role, trainer_group(role)
        self.keys = Keys(config.run.name)
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = get_logger(service="trainer", run=config.run.name)
        self.r = connect(config.run.redis_url, autostart=config.run.autostart_redis)
        self.ledger = Ledger(self.r, self.keys)
        self.consumer = bus.GroupConsumer(
            self.r,
            self.keys.trajectories,
            self.group,
            self.cfg.consumer,
            kind=schemas.Trajectory,
            deadletter_stream=self.keys.deadletter,
        )
        self.leader = leader  # rank 0 of several: the other ranks make every backend call with us
        self.store = CheckpointStore(self.run_dir / "checkpoints", leader.world.world_size if leader else 1)
        latest = self.store.latest()  # a checkpoint of another world size fails here, before the model loads
        self.backend: TrainerBackend = (
            backend
            if isinstance(backend, TrainerBackend)
            else make_backend(backend or self.cfg.backend, config)
        )
        # where the model really is ("auto" resolved), for the started line
        device = str(getattr(self.backend, "device", self.cfg.device))
        if leader is not None:
            self.backend = distributed.LeaderBackend(self.backend, leader)
        self.publisher = Publisher(
            self.r,
            self.keys,
            self.run_dir,
            keep_versions=self.cfg.keep_versions,
            weights_format=self.cfg.weights_format,
            shard_bytes=self.cfg.weights_shard_mb << 20,
            write_threads=self.cfg.weights_write_threads,
            adapter_config=self.backend.adapter_config(),
            role=role,
        )
        self.state = TrainerState()
        if latest is not None:
            self.state, path = latest
            self.backend.load_state(path / "state.pt")
        self.books = Bookkeeping(
            self.state, group_wait_s=self.cfg.group_wait_s, max_attempts=config.scheduler.max_attempts
        )
        self.sft = sft.SftSelector(self.cfg.sft, self.cfg.sft_threshold)
        self.teacher = distill.connect(config)  # None without trainer.distill_url; refuses another tokenizer
        self.distill_metrics: dict[str, float] = {}
        cfg = self.cfg
        self.cadence = CheckpointCadence(cfg.checkpoint_every, cfg.checkpoint_every_s, cfg.checkpoint_idle_s)
        self.stopping = False
        self.wait_started = time.perf_counter()
        self.dead_lettered = 0
        self.metrics_port = 0  # set by run(): where /metrics listens, announced in the heartbeat
        self.metrics = standard_metrics()
        self.tracer = tracer_for(config, "trainer", metrics=REGISTRY)
        self.heartbeat = HeartbeatWriter(self.r, self.keys, "trainer", self.cfg.consumer, every_s=HEARTBEAT_S)
        self.outage = RedisOutage(
            config.run.redis_url,
            config.run.redis_outage_s,
            self.log,
            on_outage=self.metrics.errors.labels(kind="redis_outage").inc,
        )
        durability.check(
            self.r,
            config.run.redis_durability,
            self.log,
            service="trainer",
            want_waitaof=config.run.redis_waitaof,
        )
        self._observe_state()
        self._reconcile_trained_log()
        self.log.info(
            "trainer_started",
            step=self.state.step,
            version=self.state.version,
            resumed=latest is not None,
            done_keys=len(self.state.trained) + len(self.state.consumed),
            device=device,
        )

    # --- lifecycle -----------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self.stopping = True

    def run(self) -> int:
        """Train until max_steps or a stop; ride through Redis outages (RedisUnavailable past
        run.redis_outage_s)."""
        recovering, first = True, True
        try:
            while True:
                try:
                    if recovering:
                        self._recover(announce=first)
                        recovering = first = False
                    if self.stopping or self._reached_max_steps():
                        self._flush()
                        break
                    self._work_once()
                except REDIS_ERRORS as exc:  # uncommitted work is still in the pending list
                    self._checkpoint_deferred()  # the model is ahead of the checkpoint: catch it up
                    self.outage.wait(self.r, exc, where="trainer loop")
                    recovering = True
        finally:  # other exceptions propagate uncommitted: a restart replays from the checkpoint
            self._stopped()
        return 0

    def _recover(self, *, announce: bool) -> None:
        """What a restart does, without reloading the model: forget what is not durable,
        announce the current version, re-read own pending entries (those a checkpoint covers
        get their ledger moves again and are acked)."""
        self.books.reset()
        bus.ensure_group(self.r, self.keys.trajectories, self.group)
        self._detect_lost_writes()
        if resume_version(self.state, self.publisher.published_version()):
            self.log.warning("version_past_lost_steps", version=self.state.version, step=self.state.step)
        self._ensure_published()
        if announce:
            self._event("started", step=self.state.step, version=self.state.version)
        self._handle(self.consumer.read(PENDING_REPLAY_COUNT, own_pending=True))
        self.wait_started = time.perf_counter()

    def _work_once(self) -> None:
        """One read, the groups it completes, and a step when enough are ready."""
        self._heartbeat()
        if self.leader is not None:
            self.leader.idle()  # the other ranks wait for our next command with a deadline
        deadline = self.books.assembler.next_deadline_s()
        block_ms = READ_BLOCK_MS if deadline is None else max(1, min(READ_BLOCK_MS, int(deadline * 1000)))
        end = self._data_end()  # before the read: see _train_the_rest
        deliveries = self.consumer.read(READ_COUNT, block_ms=block_ms)
        self.cadence.read(bool(deliveries))
        self._handle(deliveries)
        self.books.collect(self._decide)
        decisions = self.books.take_ready(self.cfg.groups_per_step)
        if decisions:
            self._step(decisions)
        elif not deliveries and end.owed_by_trainer:
            self._train_the_rest()
        elif not deliveries and self.books.uncommitted() and self.cadence.due_when_quiet():
            # The stream went quiet with filtered groups uncommitted: commit them now. The
            # scheduler holds a group until the trainer has consumed it, so waiting for the
            # next step could wait forever (all in-flight groups held).
            self._commit(bump=False)

    def _train_the_rest(self) -> None:
        """The end of the data (shared/dataend): the scheduler said no training group is coming
        before a read that returned nothing, so every training trajectory has been read. What is
        held trains now as a last, smaller step (the loss is normalised per step), groups still
        open close without their missing members, the last version is published, and the
        scheduler is told which one it is (it validates that version)."""
        self.books.collect(self._decide, now=math.inf)  # nothing more can join an open group
        while self.books.ready:
            take = min(len(self.books.ready), self.cfg.groups_per_step)
            last = take == len(self.books.ready)  # before take_ready shortens the list
            self._step(self.books.take_ready(take), last=last)
        self._flush()
        # The checkpoint says which step the newest version holds (the `weights` stream is not
        # read back: a malformed entry there must not stop the end of the data).
        if self.state.version_step < self.state.step:  # steps since the last publication (publish_every > 1)
            self._commit(bump=True)
            self.publisher.publish(self.state.version, self.state.step, self.backend.weights())
        self._announce_trained()
        self._event("data_trained", version=self.state.version, step=self.state.step)
        self.log.info("data_trained", version=self.state.version, step=self.state.step)

    def _data_end(self) -> dataend.DataEnd:
        return dataend.read(self.r, self.keys)

    def _announce_trained(self) -> None:
        dataend.announce_trained(self.r, self.keys, self.state.version, self.state.step)

    def _flush(self) -> None:
        if self.books.uncommitted():  # filtered/late work seen since the last step
            self._commit(bump=False)

    def _stopped(self) -> None:
        try:
            self._event("stopped", step=self.state.step, version=self.state.version)
            if sys.exc_info()[0] is None:  # a clean exit (not an error on its way out): say so
                self.heartbeat.stop(
                    version=self.state.version,
                    step=self.state.step,
                    open_groups=len(self.books.assembler.open),
                    ready_groups=len(self.books.ready),
                )
        except REDIS_ERRORS:
            pass  # exiting because Redis is gone: the log line below still says so
        self.tracer.close()
        self.log.info(
            "trainer_stopped",
            step=self.state.step,
            version=self.state.version,
            dead_lettered=self.dead_lettered + self.consumer.dead_lettered,
            redis_outages=self.outage.outages,
            otel_spans_dropped=self.tracer.dropped,
        )

    def _reached_max_steps(self) -> bool:
        return bool(self.cfg.max_steps) and self.state.step >= self.cfg.max_steps

    # --- intake ---------------------------------------------------------------
    def _handle(self, deliveries: list[bus.Delivery]) -> None:
        covered: list[bus.Delivery] = []
        ack_now: list[str] = []  # copies, validation attempts, duplicates: nothing to commit
        for delivery in deliveries:
            traj: schemas.Trajectory = delivery.message
            seen = self.books.seen(traj.key)
            if seen is Seen.DONE:
                covered.append(delivery)  # a durable checkpoint already covers it
            elif seen is Seen.IN_FLIGHT or traj.mode != "train":
                ack_now.append(delivery.entry_id)  # a second copy, or validation (the scheduler's)
            elif self._in_vocab(delivery) and self.books.add(delivery.entry_id, traj) == "duplicate":
                ack_now.append(delivery.entry_id)  # same key twice in one open group
        self.consumer.ack(ack_now)
        if covered:  # a crash fell between a checkpoint and its acks: settle them now
            done = self.books.covered(d.message.key for d in covered)
            self._settle(done, [d.entry_id for d in covered])

    def _in_vocab(self, delivery: bus.Delivery) -> bool:
        try:
            check_vocab(delivery.message, self.backend.vocab_size)
        except OutOfVocab as exc:
            self._dead_letter(delivery, str(exc))
            return False
        return True

    def _dead_letter(self, delivery: bus.Delivery, reason: str) -> None:
        traj: schemas.Trajectory = delivery.message
        pipe = self.r.pipeline(transaction=True)
        bus.dead_letter(
            self.r,
            self.keys.deadletter,
            source=self.keys.trajectories,
            entry_id=delivery.entry_id,
            reason=reason,
            raw=schemas.encode(traj),
            group=self.group,
            pipe=pipe,
        )
        self.ledger.apply("reject", [traj.key], pipe=pipe)
        pipe.xack(self.keys.trajectories, self.group, delivery.entry_id)
        pipe.execute()
        self.dead_lettered += 1
        self.metrics.deadlettered.labels(source="trajectories").inc()
        self.log.warning("trajectory_dead_lettered", key=traj.key, reason=reason)

    def _decide(self, group: CompleteGroup) -> GroupDecision:
        caps = TurnCaps(self.cfg.max_turn_tokens, self.cfg.max_turns_per_trajectory, self.config.run.seed)
        sft_on = sft.active(self.sft, self.state.step, self.cfg.sft_until_step)
        decision = decide_group(
            group.group_id,
            [m.trajectory for m in group.members],
            trainer_version=self.state.version,
            max_staleness=self.cfg.max_sample_age,
            overlong=self.cfg.overlong,
            max_seq_len=self.cfg.max_seq_len,
            advantage=self.cfg.advantage,
            caps=caps,
            turn_gamma=self.cfg.turn_gamma,
            keep_zero_variance=sft_on or self.teacher is not None,
        )
        if sft_on:
            self.sft.mark(decision)
        self.books.pending.counts.update(decision.capped)  # capped:<cap> in the next commit's metrics
        return decision

    # --- one step ------------------------------------------------------------
    def _step(self, decisions: list[GroupDecision], *, last: bool = False) -> None:
        wait_s = time.perf_counter() - self.wait_started
        samples, stats = self._samples(decisions)
        train_start, step_began = time.perf_counter(), time.time()
        metrics: dict[str, float] = {}
        if samples:
            metrics = self.backend.train_step(samples)
            self.state.step += 1
        train_s = time.perf_counter() - train_start
        publish_start, trained_at = time.perf_counter(), time.time()
        bump = bool(samples) and (last or self.state.step % self.cfg.publish_every == 0)
        if bump:
            self.state.version += 1
            self.state.version_step = self.state.step
        if samples:
            self.books.stepped(self.state.step, self.state.version)
            self.cadence.stepped()
        counts = self.books.take_counts()
        # Checkpoint, publish, then settle. The checkpoint is durable before its version is
        # announced (a crash between the two republishes at start, _ensure_published). The
        # ledger hears that the step's groups are trained only after the version they made is
        # announced: the scheduler releases a held group on that word and dispatches the next one
        # at the announced version, so a release seen before the publish sent the next group out
        # on the version just trained over, to reach the trainer one version older than the
        # dispatch lag allows (filtered:stale, a wasted rollout).
        commit = last or self.cadence.due_after_step() or (not samples and not self.cadence.steps_since)
        sealed = self._checkpoint() if commit else None  # else deferred: entries stay pending (cadence.py)
        if bump:
            self.publisher.publish(self.state.version, self.state.step, self.backend.weights())
            self.publisher.prune()
        if sealed is not None:
            self._settle(sealed.done, sealed.entry_ids)
        publish_s = time.perf_counter() - publish_start
        if samples and self.tracer.enabled:
            keys = [t.key for d in decisions for t in d.train]
            version = self.state.version if bump else None
            step_span = self.tracer.trainer_step(self.state.step, keys, step_began, trained_at, version)
            if bump:
                self.tracer.publication(
                    self.state.version, self.state.step, trained_at, time.time(), step_span
                )
        if samples:
            metrics.update(self._step_metrics(decisions, samples, stats, counts))
            metrics.update(
                {
                    "time/wait_s": wait_s,
                    "time/train_s": train_s,
                    "time/publish_s": publish_s,
                    "tokens_per_s": metrics["tokens"] / train_s if train_s > 0 else 0.0,
                }
            )
            self._emit_metrics(metrics)
            self.metrics.tokens.labels(kind="trained").inc(metrics["tokens"])
            self.metrics.tokens_per_second.labels(service="trainer").set(metrics["tokens_per_s"])
        self._observe_state()
        self.wait_started = time.perf_counter()

    def _samples(self, decisions: list[GroupDecision]) -> tuple[list[Sample], SplitStats]:
        """The step's samples; members left with no trained token are consumed instead."""
        stats = SplitStats()
        samples: list[Sample] = []
        mask_truncated = self.cfg.overlong == "mask"
        for decision in decisions:
            for traj in decision.train:
                got = []
                if traj.key in decision.advantages or self.teacher is not None:
                    got = trajectory_to_samples(
                        traj,
                        advantage=decision.advantages.get(traj.key, 0.0),
                        mask_truncated=mask_truncated,
                        stats=stats,
                        turn_advantages=decision.turn_advantages.get(traj.key),
                    )
                if traj.key in decision.sft:
                    got += sft.sft_samples(traj, mask_truncated=mask_truncated, stats=stats)
                if sum(s.trained_tokens for s in got) == 0:
                    reason = FilterReason.OVERLONG if mask_truncated else FilterReason.NO_TRAINED_TOKENS
                    self.books.drop(traj.key, reason)
                    continue
                samples.extend(got)
                self.books.train(traj.key)
            self.books.close(decision)
        if self.teacher is not None and samples:
            self.distill_metrics = distill.apply(
                samples, self.teacher, coef=self.cfg.distill_coef, reward_coef=self.cfg.distill_reward_coef
            )
        return samples, stats

    def _commit(self, *, bump: bool) -> Counter:
        """Checkpoint, then the trained log, then ledger and acks for everything it covers.
        Returns the commit's counts (filtered:<reason>, late, groups_timed_out) for metrics."""
        if bump:
            self.state.version += 1
            self.state.version_step = self.state.step
        sealed = self._checkpoint()
        self._settle(sealed.done, sealed.entry_ids)
        return sealed.counts

    def _checkpoint(self) -> Sealed:
        """Seal the next commit (every step since the last checkpoint) and write it durably:
        the checkpoint, then its steps in trained.jsonl. Local files only."""
        self.state.commit += 1
        sealed = self.books.seal(self.state.step)
        self.store.save(self.state, self.backend.save_state, sealed.done)
        self.cadence.checkpointed()
        for step, version, keys in sealed.steps:  # local and durable before any Redis write that may fail
            self._append_trained_log(step, version, keys)
        return sealed

    def _checkpoint_deferred(self) -> None:
        """Redis went away with steps deferred: the model holds updates no checkpoint covers and
        the recovery forgets what is not durable, so make them durable now; the recovery then
        settles their entries from the done set like after a crash."""
        if self.cadence.steps_since and not self.books.pending.trained:
            self._checkpoint()

    def _settle(self, done: DoneDelta, entry_ids: list[str]) -> None:
        """Ledger moves and acks for entries a durable checkpoint covers, in one transaction
        (idempotent: replaying it after a crash or an outage changes nothing)."""
        pipe = self.r.pipeline(transaction=True)
        for name, reason, keys in ledger_moves(done):
            self.ledger.apply(name, keys, reason=reason, pipe=pipe)
        if entry_ids:
            pipe.xack(self.keys.trajectories, self.group, *entry_ids)
        pipe.hset(self.keys.durable, "trainer_commit", self.state.commit)
        pipe.execute()
        if self.config.run.redis_waitaof:  # the acks may not be lost to a host crash once we go on
            durability.waitaof(self.r, self.config.run.redis_waitaof_timeout_ms, self.log, "trainer_settle")

    def _detect_lost_writes(self) -> None:
        """Redis older than our checkpoint (an AOF tail lost to a host crash): said loudly, and
        healed by what follows, since every entry read again is settled from the done set and
        never trained twice; trajectories Redis lost entirely are attempts it will run again."""
        raw = self.r.hget(self.keys.durable, "trainer_commit")
        seen = durability.LostWrites(int(raw) if raw is not None else 0, self.state.commit)
        if not seen.lost:
            return
        self.metrics.errors.labels(kind="redis_lost_writes").inc()
        self._event(
            "redis_lost_writes", redis_commit=seen.redis_commit, checkpoint_commit=seen.checkpoint_commit
        )
        self.log.error(
            "redis_lost_writes",
            redis_commit=seen.redis_commit,
            checkpoint_commit=seen.checkpoint_commit,
            advice="Redis came back without writes it had accepted: check appendfsync and the host; "
            "see docs/operating.md, Durability",
        )

    # --- outputs ---------------------------------------------------------------
    def _ensure_published(self) -> None:
        published = self.publisher.published_version()
        if published is None or published < self.state.version:
            self.publisher.publish(self.state.version, self.state.step, self.backend.weights())
            self.log.info(
                "weights_published", version=self.state.version, step=self.state.step, at_start=True
            )

    def _step_metrics(
        self, decisions: list[GroupDecision], samples: list[Sample], stats: SplitStats, counts: Counter
    ) -> dict[str, float]:
        rewards = np.asarray([r for d in decisions for r in d.rewards], dtype=np.float64)
        adv = np.asarray(
            [d.advantages[t.key] for d in decisions for t in d.train if t.key in d.advantages],
            dtype=np.float64,
        )
        out: dict[str, float] = {
            "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward_std": float(rewards.std()) if rewards.size else 0.0,
            "advantage_mean": float(adv.mean()) if adv.size else 0.0,
            "advantage_std": float(adv.std()) if adv.size else 0.0,
            "advantage_abs_max": float(np.abs(adv).max()) if adv.size else 0.0,
            "groups": float(len(decisions)),
            "trajectories": float(sum(len(d.train) for d in decisions)),
            "samples": float(len(samples)),
            "sft_samples": float(sum(s.sft for s in samples)),
            "merged_turns": float(stats.merged_turns),
            "turn_mismatches": float(stats.mismatches),
            "masked_truncated_turns": float(stats.masked_truncated),
            "dead_lettered_total": float(self.dead_lettered + self.consumer.dead_lettered),
        }
        out.update(self.distill_metrics)
        for name, value in counts.items():
            out[name] = float(value)
        for staleness, n in Counter(s for d in decisions for s in d.staleness).items():
            out[f"staleness/{staleness}"] = float(n)
        return out

    def _emit_metrics(self, values: dict[str, float]) -> None:
        message = schemas.Metrics(
            run=self.keys.run, step=self.state.step, version=self.state.version, values=values, role=self.role
        )
        bus.publish(self.r, self.keys.metrics, message, maxlen=METRICS_MAXLEN)
        line = {"step": self.state.step, "version": self.state.version, "time": message.time, **values}
        with open(self.run_dir / "metrics.jsonl", "ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
        self.log.info(
            "step",
            step=self.state.step,
            version=self.state.version,
            loss=round(values.get("loss", 0.0), 5),
            reward_mean=round(values.get("reward_mean", 0.0), 4),
            trajectories=int(values.get("trajectories", 0)),
            train_s=round(values["time/train_s"], 3),
        )

    def _append_trained_log(self, step: int, version: int, keys: list[str]) -> None:
        with open(self.run_dir / TRAINED_LOG, "ab") as handle:
            handle.write(orjson.dumps({"step": step, "version": version, "keys": keys}) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def _reconcile_trained_log(self) -> None:
        """Make trained.jsonl list exactly the checkpointed steps (a crash can fall between
        the checkpoint's rename and the log line)."""
        path = self.run_dir / TRAINED_LOG
        lines = []
        if path.exists():
            for raw in path.read_bytes().splitlines():
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue  # a torn last line
                if line["step"] <= self.state.step:
                    lines.append(line)
        logged = {line["step"] for line in lines}
        missing: dict[int, list[str]] = {}
        for key, step in self.state.trained.items():
            if step not in logged:
                missing.setdefault(step, []).append(key)
        lines.extend({"step": s, "version": None, "keys": k} for s, k in sorted(missing.items()))
        lines.sort(key=lambda line: line["step"])
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
        os.replace(tmp, path)

    def _observe_state(self) -> None:
        """Prometheus gauges of the durable state (after start, resume and every step)."""
        self.metrics.trainer_step.set(self.state.step)
        self.metrics.weight_version.labels(role=trainer_field(self.role)).set(self.state.version)

    def _heartbeat(self) -> None:
        self.heartbeat.beat(
            version=self.state.version,
            metrics_port=self.metrics_port,
            step=self.state.step,
            open_groups=len(self.books.assembler.open),
            ready_groups=len(self.books.ready),
        )

    def _event(self, name: str, **fields: Any) -> None:
        bus.publish(
            self.r,
            self.keys.events,
            schemas.Event(run=self.keys.run, service="trainer", name=name, fields=fields),
            maxlen=EVENTS_MAXLEN,
        )


def run(config: RunConfig, backend: str | None = None) -> int:
    """One process: the Trainer (below). Several ranks (torchrun, or a Ray Train worker whose
    group is set up already): rank 0 runs the Trainer, the others follow it; whatever ends
    rank 0 (max_steps, SIGTERM, an error) is sent to them as a stop, and every rank leaves
    the process group."""
    if config.roles:  # several trained roles: one process, one Trainer per role (multirole.py)
        from .multirole import run_roles

        return run_roles(config)
    world = distributed.init_world(config.trainer.device, config.trainer.collective_timeout_s)
    if not world.distributed:
        return run_trainer(config, backend)
    # Commands wait out rank 0's longest solo work: publishing, or riding out a Redis outage.
    group = distributed.control_group(config.trainer.collective_timeout_s + config.run.redis_outage_s)
    try:
        if not world.is_main:
            return _follow(config, backend, world, group)
        leader, ok = distributed.Leader(world, group), False
        try:
            code = run_trainer(config, backend, leader)
            ok = code == 0
            return code
        finally:
            _stop_followers(leader, ok)
    finally:
        distributed.shutdown()


def _on_signal(signum: int, handler: Any) -> None:
    """Install a signal handler where Python allows it: the main thread. A Ray Train worker runs
    the trainer in a thread of its actor; there Ray stops the ranks (its actors) itself."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, handler)


def _follow(config: RunConfig, backend: str | None, world: distributed.World, group: Any) -> int:
    log = get_logger(service="trainer", run=config.run.name)
    # torchrun passes a SIGTERM to every rank; only rank 0 decides when to stop (after the
    # step and its checkpoint, which need us), so a follower waits for rank 0's stop.
    _on_signal(signal.SIGTERM, lambda *_: log.info("rank_sigterm_waits_for_rank0", rank=world.rank))
    _on_signal(signal.SIGINT, signal.SIG_IGN)
    model = make_backend(backend or config.trainer.backend, config)
    log.info("rank_following", rank=world.rank, world_size=world.world_size)
    code = distributed.follow(model, group)
    log.info("rank_stopped", rank=world.rank, exit_code=code)
    return code


def _stop_followers(leader: distributed.Leader, ok: bool) -> None:
    try:
        leader.stop(ok)
    except RuntimeError as exc:  # a rank is gone already: torchrun tears the rest down
        get_logger(service="trainer").warning("ranks_not_stopped", error=str(exc)[:300])


def record_stop_signals() -> list[int]:
    """SIGTERM and SIGINT from now on only append to the returned list: a stop that comes
    while the model loads is kept, and acted on once the trainer exists."""
    early_stop: list[int] = []
    _on_signal(signal.SIGTERM, lambda signum, _frame: early_stop.append(signum))
    _on_signal(signal.SIGINT, lambda signum, _frame: early_stop.append(signum))
    return early_stop


def run_trainer(
    config: RunConfig, backend: str | None = None, leader: distributed.Leader | None = None
) -> int:
    """Serve /health at once, build the trainer (the model loads), run until max_steps or a
    SIGTERM/SIGINT; /ready answers 200 only between the model being loaded and a stop."""
    from squall.monitor.health import start_health_server

    early_stop = record_stop_signals()  # a signal that came while the model was loading
    built: list[Trainer] = []
    health, port = start_health_server(
        config.trainer.metrics_host,
        config.trainer.metrics_port,
        ready=lambda: bool(built) and not built[0].stopping,
        info=lambda: (
            {"step": built[0].state.step, "version": built[0].state.version} if built else {"loading": True}
        ),
    )
    try:
        trainer = Trainer(config, backend, leader)
        trainer.metrics_port = port
        trainer.stopping = bool(early_stop)
        built.append(trainer)
        _on_signal(signal.SIGTERM, trainer.request_stop)
        _on_signal(signal.SIGINT, trainer.request_stop)
        return trainer.run()
    finally:
        health.close()

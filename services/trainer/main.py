"""The trainer loop: trajectories -> groups -> filtered, advantaged samples -> one optimizer
step -> durable checkpoint -> ledger + acks -> weights published -> metrics.

Parts (one module each, wired here and nowhere else):
- groups.GroupAssembler     complete groups from the stream (deadline, late members)
- filters.decide_group      failed / zero-variance / stale / overlong members, advantages
- advantages                GRPO, Dr.GRPO, RLOO (one scalar per trajectory)
- sequences                 turns -> merged, masked samples; padding and micro-batches
- backend (torch | verl)    the model, the loss (losses.py) and the optimizer
- checkpoint.CheckpointStore model + optimizer + RNG + the done set, write-then-rename
- publish.Publisher         safetensors + WeightVersion, pruning acknowledged versions
- ops.health               /health, /ready (model loaded, not stopping), /metrics: the
                            standard squall metrics (step, version, trained tokens, tokens/s)
Exactly-once: an entry is acked only after the checkpoint listing its key is durable; on
resume the consumer re-reads its own pending entries and skips keys in the done set.
SIGTERM: the current step finishes, is checkpointed, and the process exits 0 (a SIGTERM
while the model is still loading stops it right after loading, before any work).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from squall.ops.metrics import standard_metrics
from squall.shared import bus, schemas
from squall.shared.config import RunConfig
from squall.shared.keys import EVENTS_MAXLEN, GROUP_TRAINER, METRICS_MAXLEN, Keys
from squall.shared.ledger import Ledger
from squall.shared.logs import get_logger
from squall.shared.redisconn import connect

from .backend import TrainerBackend, make_backend
from .checkpoint import CheckpointStore, TrainerState
from .filters import GroupDecision, decide_group
from .groups import GroupAssembler
from .publish import Publisher
from .sequences import OutOfVocab, Sample, SplitStats, check_vocab, trajectory_to_samples

READ_COUNT = 256  # entries per XREADGROUP
READ_BLOCK_MS = 500  # longest blocking read: SIGTERM and group deadlines are checked this often
PENDING_REPLAY_COUNT = 1_000_000  # own pending entries re-read at start (all of them)
HEARTBEAT_S = 5.0
# The trainer moves an attempt only out of these states; the scheduler owns the rest
# (failed/timeout -> retried/deadlettered), so the two never overwrite each other.
TRAINER_FROM = ("new", "pending", "running", "ok")
TRAINED_LOG = "trained.jsonl"  # one line per durable step: {"step", "version", "keys"}


@dataclass
class Uncommitted:
    """Work consumed since the last checkpoint; acked and ledgered once one covers it."""

    entry_ids: list[str] = field(default_factory=list)
    consumed: dict[str, str] = field(default_factory=dict)  # key -> reason (filtered/late)
    groups: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # filtered/<reason>, late, ... for metrics


class Trainer:
    def __init__(self, config: RunConfig, backend: str | None = None) -> None:
        self.config, self.cfg = config, config.trainer
        self.keys = Keys(config.run.name)
        self.run_dir = Path(config.run.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = get_logger(service="trainer", run=config.run.name)
        self.r = connect(config.run.redis_url, autostart=config.run.autostart_redis)
        self.ledger = Ledger(self.r, self.keys)
        self.consumer = bus.GroupConsumer(
            self.r, self.keys.trajectories, GROUP_TRAINER, self.cfg.consumer,
            kind=schemas.Trajectory, deadletter_stream=self.keys.deadletter,
        )  # fmt: skip
        self.store = CheckpointStore(self.run_dir / "checkpoints")
        self.backend: TrainerBackend = make_backend(backend or self.cfg.backend, config)
        self.publisher = Publisher(self.r, self.keys, self.run_dir, keep_versions=self.cfg.keep_versions)
        self.state = TrainerState()
        latest = self.store.latest()
        if latest is not None:
            self.state, path = latest
            self.backend.load_state(path / "state.pt")
        self.assembler = GroupAssembler(
            group_wait_s=self.cfg.group_wait_s,
            max_attempts=config.scheduler.max_attempts,
            done_groups=self.state.done_groups,
        )
        self.ready: list[GroupDecision] = []  # complete groups with something to train
        self.entry_ids: dict[str, str] = {}  # trajectory key -> stream entry id, for ready groups
        self.pending = Uncommitted()
        self.stopping = False
        self.last_heartbeat = 0.0
        self.wait_started = time.perf_counter()
        self.dead_lettered = 0
        self.metrics_port = 0  # set by run(): where /metrics listens, announced in the heartbeat
        self.metrics = standard_metrics()
        self._observe_state()
        self._reconcile_trained_log()
        self.log.info(
            "trainer_started", step=self.state.step, version=self.state.version,
            resumed=latest is not None, done_keys=len(self.state.trained) + len(self.state.consumed),
        )  # fmt: skip

    # --- lifecycle -----------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self.stopping = True

    def run(self) -> int:
        self._ensure_published()
        self._event("started", step=self.state.step, version=self.state.version)
        self._handle(self.consumer.read(PENDING_REPLAY_COUNT, own_pending=True))
        try:
            while not self.stopping and not self._reached_max_steps():
                self._heartbeat()
                deadline = self.assembler.next_deadline_s()
                block_ms = (
                    READ_BLOCK_MS if deadline is None else max(1, min(READ_BLOCK_MS, int(deadline * 1000)))
                )
                deliveries = self.consumer.read(READ_COUNT, block_ms=block_ms)
                self._handle(deliveries)
                self._collect_complete_groups()
                if len(self.ready) >= self.cfg.groups_per_step:
                    self._step(self.ready[: self.cfg.groups_per_step])
                    self.ready = self.ready[self.cfg.groups_per_step :]
                elif not deliveries and self.pending.entry_ids:
                    # The stream went quiet with filtered groups uncommitted: commit them now.
                    # The scheduler holds a group until the trainer has consumed it, so waiting
                    # for the next step could wait forever (all in-flight groups held).
                    self._commit(trained={}, version_bumped=False)
            if self.pending.entry_ids:  # filtered/late work seen since the last step
                self._commit(trained={}, version_bumped=False)
        finally:  # an exception propagates uncommitted: a restart replays from the last checkpoint
            self._event("stopped", step=self.state.step, version=self.state.version)
            self.log.info("trainer_stopped", step=self.state.step, version=self.state.version,
                          dead_lettered=self.dead_lettered + self.consumer.dead_lettered)  # fmt: skip
        return 0

    def _reached_max_steps(self) -> bool:
        return bool(self.cfg.max_steps) and self.state.step >= self.cfg.max_steps

    # --- intake ---------------------------------------------------------------
    def _handle(self, deliveries: list[bus.Delivery]) -> None:
        covered: list[bus.Delivery] = []
        for delivery in deliveries:
            traj: schemas.Trajectory = delivery.message
            if self.state.is_done(traj.key):
                covered.append(delivery)  # a durable checkpoint already covers it
                continue
            if traj.key in self.entry_ids or traj.key in self.pending.consumed:
                self.consumer.ack([delivery.entry_id])  # a second copy of an attempt in flight here
                continue
            if traj.mode != "train":
                self.consumer.ack([delivery.entry_id])  # validation: the scheduler records it
                continue
            try:
                check_vocab(traj, self.backend.vocab_size)
            except OutOfVocab as exc:
                self._dead_letter(delivery, traj, str(exc))
                continue
            outcome = self.assembler.add(delivery.entry_id, traj)
            if outcome == "late":
                self._consume(delivery.entry_id, traj.key, "late")
            elif outcome == "duplicate":
                self.consumer.ack([delivery.entry_id])  # same key twice in one open group
        if covered:
            self._finish_covered(covered)

    def _finish_covered(self, deliveries: list[bus.Delivery]) -> None:
        """Entries a checkpoint covers but that were not acked (a crash between the checkpoint
        and the acks): redo the idempotent ledger moves, then ack."""
        by_state: dict[str, list[str]] = {}
        for delivery in deliveries:
            key = delivery.message.key
            reason = self.state.consumed.get(key)
            if key in self.state.trained:
                by_state.setdefault("trained", []).append(key)
            elif reason == "late":
                by_state.setdefault("late", []).append(key)
            elif reason not in (None, "failed", "timeout", "cancelled"):
                by_state.setdefault(f"filtered:{reason}", []).append(key)
        for state, keys in by_state.items():
            self.ledger.move(keys, state, allowed_from=TRAINER_FROM)
        self.consumer.ack([d.entry_id for d in deliveries])

    def _dead_letter(self, delivery: bus.Delivery, traj: schemas.Trajectory, reason: str) -> None:
        bus.dead_letter(
            self.r, self.keys.deadletter, source=self.keys.trajectories, entry_id=delivery.entry_id,
            reason=reason, raw=schemas.encode(traj), group=GROUP_TRAINER,
        )  # fmt: skip
        self.ledger.move([traj.key], "deadlettered", allowed_from=TRAINER_FROM)
        self.consumer.ack([delivery.entry_id])
        self.dead_lettered += 1
        self.metrics.deadlettered.labels(source="trajectories").inc()
        self.log.warning("trajectory_dead_lettered", key=traj.key, reason=reason)

    def _consume(self, entry_id: str, key: str, reason: str) -> None:
        self.pending.entry_ids.append(entry_id)
        self.pending.consumed[key] = reason
        self.pending.counts[reason if reason == "late" else f"filtered/{reason}"] += 1

    def _collect_complete_groups(self) -> None:
        for group in self.assembler.pop_complete():
            decision = decide_group(
                group.group_id, [m.trajectory for m in group.members],
                trainer_version=self.state.version, max_staleness=self.cfg.max_staleness,
                overlong=self.cfg.overlong, max_seq_len=self.cfg.max_seq_len, advantage=self.cfg.advantage,
            )  # fmt: skip
            entry_of = {m.trajectory.key: m.entry_id for m in group.members}
            self.entry_ids.update(entry_of)
            if not decision.train:  # nothing to wait for: commit the filtered members now
                self._consume_filtered(decision)
                self.pending.groups.append(group.group_id)
            if group.timed_out:
                self.pending.counts["groups_timed_out"] += 1
            if decision.train:
                self.ready.append(decision)

    def _consume_filtered(self, decision: GroupDecision) -> None:
        """Filtered members are committed with their group, never before: a restart then
        re-reads the whole group and recomputes the same baseline."""
        for reason, members in decision.filtered.items():
            for traj in members:
                self._consume(self.entry_ids.pop(traj.key), traj.key, reason)

    # --- one step ------------------------------------------------------------
    def _step(self, decisions: list[GroupDecision]) -> None:
        wait_s = time.perf_counter() - self.wait_started
        stats = SplitStats()
        samples: list[Sample] = []
        trained_keys: list[str] = []
        mask_truncated = self.cfg.overlong == "mask"
        for decision in decisions:
            self._consume_filtered(decision)
            entry_of = self.entry_ids
            for traj in decision.train:
                got = trajectory_to_samples(
                    traj, advantage=decision.advantages[traj.key], mask_truncated=mask_truncated, stats=stats
                )
                if sum(s.trained_tokens for s in got) == 0:
                    self._consume(
                        entry_of[traj.key], traj.key, "overlong" if mask_truncated else "no_trained_tokens"
                    )
                    continue
                samples.extend(got)
                trained_keys.append(traj.key)
                self.pending.entry_ids.append(entry_of[traj.key])
            self.pending.groups.append(decision.group_id)
        for decision in decisions:
            for traj in decision.train:
                self.entry_ids.pop(traj.key, None)
        train_start = time.perf_counter()
        metrics: dict[str, float] = {}
        if samples:
            metrics = self.backend.train_step(samples)
            self.state.step += 1
        train_s = time.perf_counter() - train_start
        publish_start = time.perf_counter()
        bump = bool(samples) and self.state.step % self.cfg.publish_every == 0
        counts = Counter(self.pending.counts)
        self._commit(trained={k: self.state.step for k in trained_keys}, version_bumped=bump)
        if bump:
            self.publisher.publish(self.state.version, self.state.step, self.backend.weights())
            self.publisher.prune()
        publish_s = time.perf_counter() - publish_start
        if samples:
            metrics.update(self._step_metrics(decisions, samples, stats, counts))
            metrics.update({
                "time/wait_s": wait_s, "time/train_s": train_s, "time/publish_s": publish_s,
                "tokens_per_s": metrics["tokens"] / train_s if train_s > 0 else 0.0,
            })  # fmt: skip
            self._emit_metrics(metrics)
            self.metrics.tokens.labels(kind="trained").inc(metrics["tokens"])
            self.metrics.tokens_per_second.labels(service="trainer").set(metrics["tokens_per_s"])
        self._observe_state()
        self.wait_started = time.perf_counter()

    def _commit(self, *, trained: dict[str, int], version_bumped: bool) -> None:
        """Checkpoint, then ledger and acks for everything the checkpoint covers."""
        if version_bumped:
            self.state.version += 1
        self.state.trained.update(trained)
        self.state.consumed.update(self.pending.consumed)
        self.state.done_groups.extend(self.pending.groups)
        self.state.commit += 1
        self.store.save(self.state, self.backend.save_state)
        if trained:
            self.ledger.move(list(trained), "trained", allowed_from=TRAINER_FROM)
            self._append_trained_log(self.state.step, list(trained))
        by_reason: dict[str, list[str]] = {}
        for key, reason in self.pending.consumed.items():
            by_reason.setdefault(reason, []).append(key)
        for reason, keys in by_reason.items():
            if reason in ("failed", "timeout", "cancelled"):
                continue  # the scheduler's retry path owns these attempts' ledger state
            if reason == "late":
                self.ledger.move(keys, "late", allowed_from=TRAINER_FROM)
            else:
                self.ledger.move(keys, f"filtered:{reason}", allowed_from=TRAINER_FROM)
        self.consumer.ack(self.pending.entry_ids)
        self.pending = Uncommitted()

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
        adv = np.asarray([d.advantages[t.key] for d in decisions for t in d.train], dtype=np.float64)
        out: dict[str, float] = {
            "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            "reward_std": float(rewards.std()) if rewards.size else 0.0,
            "advantage_mean": float(adv.mean()) if adv.size else 0.0,
            "advantage_std": float(adv.std()) if adv.size else 0.0,
            "advantage_abs_max": float(np.abs(adv).max()) if adv.size else 0.0,
            "groups": float(len(decisions)),
            "trajectories": float(sum(len(d.train) for d in decisions)),
            "samples": float(len(samples)),
            "merged_turns": float(stats.merged_turns),
            "turn_mismatches": float(stats.mismatches),
            "masked_truncated_turns": float(stats.masked_truncated),
            "dead_lettered_total": float(self.dead_lettered + self.consumer.dead_lettered),
        }
        for name, value in counts.items():
            out[name] = float(value)
        for staleness, n in Counter(s for d in decisions for s in d.staleness).items():
            out[f"staleness/{staleness}"] = float(n)
        return out

    def _emit_metrics(self, values: dict[str, float]) -> None:
        message = schemas.Metrics(
            run=self.keys.run, step=self.state.step, version=self.state.version, values=values
        )
        bus.publish(self.r, self.keys.metrics, message, maxlen=METRICS_MAXLEN)
        line = {"step": self.state.step, "version": self.state.version, "time": message.time, **values}
        with open(self.run_dir / "metrics.jsonl", "ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
        self.log.info("step", step=self.state.step, version=self.state.version,
                      loss=round(values.get("loss", 0.0), 5), reward_mean=round(values.get("reward_mean", 0.0), 4),
                      trajectories=int(values.get("trajectories", 0)), train_s=round(values["time/train_s"], 3))  # fmt: skip

    def _append_trained_log(self, step: int, keys: list[str]) -> None:
        with open(self.run_dir / TRAINED_LOG, "ab") as handle:
            handle.write(orjson.dumps({"step": step, "version": self.state.version, "keys": keys}) + b"\n")
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
        self.metrics.weight_version.labels(role="trainer").set(self.state.version)

    def _heartbeat(self) -> None:
        now = time.time()
        if now - self.last_heartbeat < HEARTBEAT_S:
            return
        self.last_heartbeat = now
        beat = {"time": now, "step": self.state.step, "version": self.state.version, "pid": os.getpid(),
                "metrics_port": self.metrics_port, "open_groups": len(self.assembler.open), "ready_groups": len(self.ready)}  # fmt: skip
        self.r.hset(self.keys.heartbeats, f"trainer:{self.cfg.consumer}", orjson.dumps(beat))

    def _event(self, name: str, **fields: Any) -> None:
        bus.publish(self.r, self.keys.events, schemas.Event(run=self.keys.run, service="trainer", name=name, fields=fields),
                    maxlen=EVENTS_MAXLEN)  # fmt: skip


def run(config: RunConfig, backend: str | None = None) -> int:
    """Serve /health at once, build the trainer (the model loads), run until max_steps or a
    SIGTERM/SIGINT; /ready answers 200 only between the model being loaded and a stop."""
    from squall.ops.health import start_health_server

    early_stop: list[int] = []  # a signal that came while the model was loading
    signal.signal(signal.SIGTERM, lambda signum, _frame: early_stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: early_stop.append(signum))
    built: list[Trainer] = []
    health, port = start_health_server(
        config.trainer.metrics_host, config.trainer.metrics_port,
        ready=lambda: bool(built) and not built[0].stopping,
        info=lambda: {"step": built[0].state.step, "version": built[0].state.version} if built else {"loading": True},
    )  # fmt: skip
    try:
        trainer = Trainer(config, backend)
        trainer.metrics_port = port
        trainer.stopping = bool(early_stop)
        built.append(trainer)
        signal.signal(signal.SIGTERM, trainer.request_stop)
        signal.signal(signal.SIGINT, trainer.request_stop)
        return trainer.run()
    finally:
        health.close()

"""The scheduler: dataset -> GRPO groups -> task attempts, admission, retries, the ledger.

Parts (one module each; `Scheduler` below wires them, and none imports this module):
- `dataset`     rows, validation split, per-epoch seeded order;
- `cursor`      `Cursor`: where the scheduler is in the data, and Control's settings (Redis hash);
- `groups`      `Group`: an open group and its members' current attempts (Redis hash);
- `leader`      `Leadership`: standby while another scheduler lives, the leader epoch;
- `admission`   pure: may a training group go out (`max_inflight_groups`, `max_staleness`),
                is the data exhausted, is the run finished;
- `dispatch`    `Dispatcher`: a group's tasks + ledger `dispatch` moves in one MULTI/EXEC;
- `outcomes`    pure `decide_outcome` (duplicate / ok / retry / give up) and `Outcomes`, which
                records one in one MULTI/EXEC (with a train group's reward point);
- `validation`  pure `val_round_due` / `end_round_due`, and `Validation`, which opens and
                closes rounds;
- `ending`      `Ending`: the end of the data (shared/dataend): tells the trainer, settles the
                version the end round measures, waits for the nodes to serve it;
- `control`     pause / resume / drain / limits from the `control` stream;
- `trimming`    `Trimmer`: acknowledged `tasks`/`trajectories` entries, long-dead heartbeats;
- `report`      events and reward points (`schemas.RewardPoint` on `rewards`);
- `monitor.rollouts.RolloutKeeper`  a bounded sample of each version's attempts in the run
                folder, for reading (and re-scoring) after `trajectories` is trimmed;
- `monitor.stalls.StallWatch`  looks for stalls every `alerts.check_every_s` and writes
                `stall` / `stall_cleared` events.

The end of the data (shared/dataend.py): once the data ran out and every training group rolled
out, the scheduler tells the trainer, which trains what it still holds (a last, smaller step)
and answers with its last published version; the scheduler waits for that answer (at most
`end_wait_s`, and only while a trainer may give it), validates that version once, and finishes.

Crash safety: every step that changes the run is ONE MULTI/EXEC — a dispatch is the XADDs of
its tasks + the ledger moves to `pending` + the group record + the cursor; an outcome is the
ledger moves + the retry XADD + the group record + the XACK of the trajectory. A kill -9
before EXEC leaves nothing (the trajectory is still pending in our PEL and is handled again),
after EXEC everything; so nothing is lost or dispatched twice.

Redis outages: a Redis error anywhere in a step (or at start-up, or standing by) waits for Redis
with the shared policy (`shared.retry.RedisOutage`, deadline `run.redis_outage_s`), reloads
the cursor and groups from Redis (in memory they may only be stale, never ahead, because each
step is one transaction) and runs the step again; the next step re-reads our own pending
trajectories first. Past the deadline RedisUnavailable (naming the URL) ends the process.

Who owns which ledger move: the scheduler makes `dispatch` (new -> pending), `retry` and
`give_up` (failed/timeout/cancelled -> retried | deadlettered) and `validate` (val: ok ->
validated); runners `take` and `finish_*` (with the trajectory XADD); the trainer `train`,
`late`, `filter`, `reject`. Leases of dead runners are reclaimed by the runners themselves
(XAUTOCLAIM), which give up after `runner.max_deliveries` with a failed trajectory, so the
retry/dead-letter decision stays here.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from squall.monitor.rollouts import RolloutKeeper
from squall.monitor.stalls import StallCollector, StallWatch, Thresholds
from squall.shared import bus, dataend, durability, resources, schemas
from squall.shared.config import RunConfig
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import GROUP_RUNNERS, GROUP_SCHEDULER, Keys
from squall.shared.ledger import Ledger
from squall.shared.logs import get_logger
from squall.shared.retry import REDIS_ERRORS, RedisOutage
from squall.shared.roleplan import roles_of
from squall.shared.roles import trainer_field

from . import admission, groups, report, validation
from . import dataset as ds
from .control import apply_control
from .cursor import Cursor
from .dispatch import Dispatcher, new_group
from .ending import Ending
from .groups import Group
from .leader import Leadership
from .outcomes import FAILED_STATUSES, InfraBudget, Outcome, Outcomes, decide_outcome
from .trimming import Trimmer

__all__ = ["FAILED_STATUSES", "Cursor", "Group", "Scheduler"]

HEARTBEAT_EVERY_S = 2.0  # at most; a third of standby_after_s when that is shorter
T = TypeVar("T")


class Scheduler:
    def __init__(self, config: RunConfig, r: redis.Redis) -> None:
        self.config, self.r = config, r
        self.section = section = config.scheduler
        self.keys = keys = Keys(config.run.name)
        self.ledger = Ledger(r, keys)
        self.log = get_logger(component="scheduler")
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        self.splits = ds.split(
            ds.load_rows(section.dataset) if section.dataset else [],
            ds.load_rows(section.val_dataset) if section.val_dataset else None,
            section.val_fraction,
            config.run.seed,
        )
        self.outage = RedisOutage(config.run.redis_url, config.run.redis_outage_s, self.log)
        every_s = min(HEARTBEAT_EVERY_S, section.standby_after_s / 3)
        self.heartbeat = HeartbeatWriter(r, keys, "scheduler", self.id, every_s=every_s)
        self.leadership = Leadership(
            r, keys, self.heartbeat.field, section.standby_after_s, section.poll_s, self.log
        )
        run = config.run
        self.dispatcher = Dispatcher(
            r,
            keys,
            self.ledger,
            section,
            waitaof_ms=run.redis_waitaof_timeout_ms if run.redis_waitaof else 0,
            log=self.log,
        )
        self.outcomes = Outcomes(r, keys, self.ledger, section, self.dispatcher, self.log)
        self.validation = validation.Validation(r, keys, section, self.dispatcher, self.log)
        self.ending = Ending(r, keys, section, self.log)
        roles = [role.name for role in roles_of(config)]
        self.role_names = [role.name for role in roles_of(config) if role.declared]  # [] : one policy
        self.trimmer = Trimmer(r, keys, section.trim_every_s, self.log, roles)
        self.keeper = RolloutKeeper(config.run.dir, section.keep_rollouts_per_version)
        self.stalls = StallWatch(
            r, keys, Thresholds.from_config(config), config.alerts.check_every_s, self.log
        )
        self.cursor = Cursor()
        self.groups: dict[str, Group] = {}
        self._order: list[int] | None = None
        self.lost_lead = False  # step() saw a newer leader epoch
        self.closed_round = False  # the outcome just recorded closed a validation round
        self.counts = {
            "dispatched_groups": 0,
            "outcomes": 0,
            "retries": 0,
            "infra_retries": 0,
            "deadlettered": 0,
            "duplicates": 0,
        }
        self.metrics_port = 0
        self.started = time.monotonic()
        self.consumer: bus.GroupConsumer
        self.ride(self._attach, "start")

    def _attach(self) -> None:
        # One scheduler per run: a stable consumer name lets a restart resume its PEL.
        self.consumer = bus.GroupConsumer(
            self.r,
            self.keys.trajectories,
            GROUP_SCHEDULER,
            "scheduler",
            kind=schemas.Trajectory,
            deadletter_stream=self.keys.deadletter,
        )
        bus.ensure_group(self.r, self.keys.tasks, GROUP_RUNNERS)
        self._load_state()

    def _load_state(self) -> None:
        self.cursor = Cursor.load(self.r, self.keys)
        self.groups = groups.load_groups(self.r, self.keys)
        self._order = None

    def ride(self, work: Callable[[], T], where: str) -> T:
        """`work()`, riding through Redis outages: wait for Redis, reload the state, run it again."""
        reload = False
        while True:
            try:
                if reload:
                    self._load_state()
                return work()
            except REDIS_ERRORS as exc:
                self.outage.wait(self.r, exc, f"scheduler {where}")
                reload = True

    # --- leadership ---------------------------------------------------------------------
    @property
    def token(self) -> int | None:
        return self.leadership.token

    def is_leader(self) -> bool:
        return self.leadership.is_leader()

    def acquire(self, stopped: Callable[[], bool]) -> bool:
        """Stand by while another scheduler is alive, take the lead, then load the state."""
        waited = time.monotonic()
        announce = lambda: self._heartbeat(self.trainer_version(), force=True)  # noqa: E731
        if not self.leadership.acquire(stopped, announce):
            return False
        self._load_state()
        self.log.info(
            "scheduler_leading",
            leader_epoch=self.token,
            waited_s=round(time.monotonic() - waited, 3),
            open_groups=len(self.groups),
        )
        return True

    # --- data and admission -------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = ds.epoch_order(
                len(self.splits.train), self.cursor.epoch, self.config.run.seed, self.section.shuffle
            )
        return self._order

    def _advance(self, cursor: Cursor) -> None:
        cursor.position += 1
        if cursor.position >= len(self.splits.train):
            cursor.epoch, cursor.position = cursor.epoch + 1, 0
            self._order = None

    @property
    def exhausted(self) -> bool:
        return admission.exhausted(
            samples=self.cursor.samples,
            max_samples=self.section.max_samples,
            epoch=self.cursor.epoch,
            epochs=self.section.epochs,
            train_rows=len(self.splits.train),
        )

    def trainer_version(self) -> int:
        """The trainer's version; with several roles the lowest of theirs (a task's
        min_version then holds for whichever role serves a call)."""
        if self.role_names:
            return min(self.role_versions().values())
        raw = self.r.hget(self.keys.versions, "trainer")
        return int(raw) if raw is not None else 0

    def role_versions(self) -> dict[str, int]:
        """Each trained role's published version ([roles] runs; {} for the single policy)."""
        if not self.role_names:
            return {}
        raw = self.r.hmget(self.keys.versions, [trainer_field(role) for role in self.role_names])
        return {role: int(v) if v is not None else 0 for role, v in zip(self.role_names, raw, strict=True)}

    @property
    def max_inflight(self) -> int:
        return admission.inflight_limit(
            self.section.max_inflight_groups,
            self.cursor.max_inflight_groups,
            self.section.hold_until_trained,
            # held groups are released by the checkpoint covering them (trainer.checkpoint_every)
            self.config.trainer.groups_per_step * self.config.trainer.checkpoint_every,
        )

    @property
    def max_staleness(self) -> int:
        return admission.staleness_limit(self.section.max_dispatch_lag, self.cursor.max_staleness)

    def admits(self, version: int) -> bool:
        """May one more training group go out now? (see admission.admits)"""
        if not admission.admits(
            self.groups.values(), version, self.max_inflight, self.max_staleness, self.role_versions()
        ):
            return False
        if not any(g.resources for g in self.groups.values()):
            return True
        pins = resources.current_pins(self.r, self.keys)
        return admission.resource_lag(self.groups.values(), pins) <= self.max_staleness

    # --- dispatch -----------------------------------------------------------------------
    def _committed(self, cursor: Cursor, new: list[Group]) -> None:
        self.cursor = cursor
        self.groups.update((g.group_id, g) for g in new)
        self.counts["dispatched_groups"] += len(new)

    def dispatch_train(self, version: int) -> bool:
        """Dispatch the next training sample as a group; False when none may go out now."""
        if self.cursor.paused or self.cursor.draining or self.exhausted or not self.admits(version):
            return False
        if not self.is_leader():
            return False
        cursor = self.cursor.copy()
        sample = self.splits.train[self._epoch_order()[cursor.position]]
        group = new_group(cursor, sample, "train", self.section.group_size, version)
        group.role_versions = self.role_versions()
        cursor.samples += 1
        self._advance(cursor)
        self.dispatcher.commit([group], cursor, version)
        self._committed(cursor, [group])
        self.log.debug(
            "group_dispatched", group_id=group.group_id, sample_id=group.sample_id, version=version
        )
        return True

    def maybe_validate(self, version: int) -> bool:
        """Dispatch a validation round when one is due: periodic while training data is left
        (validation.val_round_due), then only the end round (validation.end_round_due)."""
        if self.cursor.paused or self.cursor.draining:
            return False
        common = dict(
            val_every=self.section.val_every,
            has_val=bool(self.splits.val),
            round_open=validation.round_open(self.groups.values()),
            last_val_version=self.cursor.last_val_version,
        )
        at: int | None = version
        if self.exhausted:
            at = self.end_version()
            due = validation.end_round_due(**common, val_at_end=self.section.val_at_end, end_version=at)
            due = due and at is not None and self.ending.served(at)
        else:
            due = validation.val_round_due(**common, version=version)
        if not due or at is None:
            return False
        cursor, new = self.validation.start(self.splits.val, self.cursor, at, end=self.exhausted)
        self._committed(cursor, new)
        return True

    # --- the end of the data (ending.Ending) -----------------------------------------------
    def note_data_end(self) -> None:
        """Out of data, every training group rolled out: tell the trainer (shared/dataend)."""
        if self.exhausted and admission.train_rolled_out(self.groups.values()):
            self.ending.announce(self.cursor.samples, self.groups.values())

    def end_version(self) -> int | None:
        """The version the end round measures (None: the trainer may still be training)."""
        return self.ending.version(self.trainer_version(), self.groups.values())

    # --- outcomes -----------------------------------------------------------------------
    def handle(self, delivery: bus.Delivery) -> None:
        """Carry out one trajectory's outcome (see outcomes.decide_outcome)."""
        traj: schemas.Trajectory = delivery.message
        if not self.is_leader():
            # Deposed (e.g. paused past standby_after_s): our in-memory groups are stale; the
            # entry stays pending under the shared consumer name for the leader to handle.
            self.lost_lead = True
            return
        group = self.groups.get(traj.group_id)
        outcome = decide_outcome(group, traj, self.section.max_attempts, InfraBudget.of(self.section))
        if group is None or outcome is Outcome.DUPLICATE:
            self.counts["duplicates"] += 1
            self.consumer.ack([delivery.entry_id])
            return
        self.counts["outcomes"] += 1
        self.keeper.keep(traj, group.payload, delivery.entry_id)
        retried = outcome in (Outcome.RETRY, Outcome.RETRY_INFRA)
        version = self.trainer_version() if retried else group.version
        if self.outcomes.record(delivery, group, outcome, self.cursor, version, self._close_round):
            self.groups.pop(group.group_id, None)
        self.counts["retries"] += outcome is Outcome.RETRY
        self.counts["infra_retries"] += outcome is Outcome.RETRY_INFRA
        self.counts["deadlettered"] += outcome is Outcome.GIVE_UP
        if self.closed_round:
            self.closed_round = False
            self.validation.closed(self.cursor)

    def _close_round(self, pipe: redis.client.Pipeline, group: Group) -> None:
        """In the transaction of `group`'s last outcome: the round's reward point, when this was
        its last open val group (a crash can no longer fall between the two)."""
        others = (g for g in self.groups.values() if g.group_id != group.group_id)
        if group.complete and group.mode == "val" and not validation.round_open(others):
            self.validation.close(self.cursor, pipe)
            self.closed_round = True

    def release_trained(self) -> int:
        """Drop held groups whose ok members the trainer has consumed (no attempt left in `ok`)."""
        released = groups.trained(self.r, self.keys, [g for g in self.groups.values() if g.rolled_out])
        if released:
            self.r.hdel(self.keys.groups, *[g.group_id for g in released])
            for group in released:
                self.groups.pop(group.group_id, None)
        return len(released)

    # --- the loop -----------------------------------------------------------------------
    def apply_control(self) -> None:
        apply_control(self.r, self.keys, self.cursor, self.log)

    def _heartbeat(self, version: int, *, force: bool = False) -> None:
        self.heartbeat.beat(
            force=force,
            version=version,
            metrics_port=self.metrics_port,
            open_groups=len(self.groups),
            epoch=self.cursor.epoch,
            samples=self.cursor.samples,
            **self.counts,
        )

    @property
    def finished(self) -> bool:
        """Drained with every group rolled out, or out of data with the end settled: the
        trainer's last version known and validated (see end_version)."""
        end_owed = self.exhausted and not self.cursor.draining and self._end_owed()
        return admission.finished(
            self.groups.values(),
            draining=bool(self.cursor.draining),
            exhausted=self.exhausted,
            end_owed=end_owed,
        )

    def _end_owed(self) -> bool:
        return validation.end_owed(
            val_at_end=self.section.val_at_end,
            val_every=self.section.val_every,
            has_val=bool(self.splits.val),
            last_val_version=self.cursor.last_val_version,
            end_version=self.end_version(),
        )

    def step(self) -> bool:
        """One round: control, validation, dispatch, then outcomes. False once finished."""
        if not self.is_leader():
            self.lost_lead = True
            return False
        self.apply_control()
        self.release_trained()
        version = self.trainer_version()
        self.maybe_validate(version)
        while self.dispatch_train(version):
            pass
        self.note_data_end()
        if self.finished:
            self._finish()
            return False
        self._heartbeat(version)
        self.trimmer.maybe_trim()
        self.stalls.maybe_check()
        # Entries still pending under our (shared) consumer name were left by a crash, by a
        # deposed leader that read them after losing the lead, or by an outage: handling is
        # idempotent.
        left = self.consumer.read(count=256, own_pending=True)
        for delivery in left or self.consumer.read(count=256, block_ms=int(self.section.poll_s * 1000)):
            self.handle(delivery)
        return not self.lost_lead

    def run(self) -> int:
        from prometheus_client import REGISTRY

        from squall.monitor.health import start_health_server
        from squall.monitor.metrics import QueueCollector

        REGISTRY.register(QueueCollector(self.r, self.keys))
        REGISTRY.register(StallCollector(self.r, self.keys, self.stalls.thresholds))
        health, self.metrics_port = start_health_server(
            self.section.metrics_host,
            self.section.metrics_port,
            info=lambda: {"open_groups": len(self.groups)},
        )
        try:
            return self._run()
        finally:
            health.close()

    def _run(self) -> int:
        stop = {"signal": 0}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stop.update(signal=signum))

        def stopped() -> bool:
            return bool(stop["signal"])

        while not stopped():
            if not self.ride(lambda: self.acquire(stopped), "standby"):
                continue  # stopped while standing by, or another scheduler won the race
            if self.ride(lambda: bool(self.cursor.finished) and self.finished, "start"):
                self.log.info("scheduler_already_finished", samples=self.cursor.samples)
                self.ride(lambda: self.heartbeat.stop(open_groups=len(self.groups)), "stop")  # not GONE
                return 0
            self.ride(self._start, "start")
            while not stopped() and self.ride(self.step, "step"):
                pass
            if self.lost_lead:
                self.log.warning("scheduler_lost_lead", leader_epoch=self.token, **self.counts)
                continue  # a newer scheduler leads now: stand by behind it
            if not stopped():
                return 0  # finished
        # Everything is already in Redis (each step is one transaction): a restart resumes here.
        self.ride(lambda: self._stopped(stop["signal"]), "stop")
        return 0

    def _start(self) -> None:
        self.started = time.monotonic()
        durability.check(
            self.r,
            self.config.run.redis_durability,
            self.log,
            service="scheduler",
            want_waitaof=self.config.run.redis_waitaof,
        )
        if not self.exhausted:  # data left (a resumed run, more epochs): no end is announced
            dataend.clear(self.r, self.keys)
        # The run file's [resources] become version 1 (none already published: a restart keeps them).
        published = resources.publish_initial(
            self.r, self.keys, self.config.resources.named(), source="config"
        )
        if published:
            self.log.info("resources_published", names=published)
        self.log.info(
            "scheduler_started",
            train=len(self.splits.train),
            val=len(self.splits.val),
            metrics_port=self.metrics_port,
            open_groups=len(self.groups),
            epoch=self.cursor.epoch,
            position=self.cursor.position,
            leader_epoch=self.token,
        )
        report.event(
            self.r,
            self.keys,
            "started",
            open_groups=len(self.groups),
            samples=self.cursor.samples,
            leader_epoch=self.token,
        )
        for delivery in self.consumer.read(count=10_000, own_pending=True):  # left by a crash
            self.handle(delivery)
        self.lost_lead = False

    def _stopped(self, signum: int) -> None:
        self.heartbeat.stop(open_groups=len(self.groups))
        report.event(self.r, self.keys, "stopped", signal=signum, open_groups=len(self.groups))
        self.log.info("scheduler_stopped", signal=signum, open_groups=len(self.groups), **self.counts)

    def _finish(self) -> None:
        reason = "drained" if self.cursor.draining else "dataset_exhausted"
        self.cursor.finished = 1
        self.r.hset(self.keys.scheduler_state, "finished", "1")
        end = {} if self.cursor.draining else {"end_version": self.end_version()}
        report.event(
            self.r,
            self.keys,
            "finished",
            reason=reason,
            samples=self.cursor.samples,
            open_groups=len(self.groups),
            **end,
            **self.counts,
        )
        self.heartbeat.stop(open_groups=len(self.groups))
        self.log.info(
            "scheduler_finished",
            reason=reason,
            samples=self.cursor.samples,
            open_groups=len(self.groups),
            seconds=round(time.monotonic() - self.started, 3),
            **end,
            **self.counts,
        )

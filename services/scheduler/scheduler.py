"""The scheduler: dataset -> GRPO groups -> task attempts, admission, retries, the ledger.

Parts (each wired here, none imports this module):
- `dataset`    rows, validation split, per-epoch seeded order;
- `Cursor`     where the scheduler is in the data (epoch, position, next group), in Redis;
- `Groups`     the open groups and their members' current attempts, in Redis;
- admission    `max_inflight_groups` and `max_staleness` against the trainer's version;
- outcomes     each Trajectory (group `scheduler`): ok -> member done (val: reward recorded),
               failed/timeout/cancelled -> a new attempt of that member, or dead-letter.

Crash safety: every step that changes the run is ONE MULTI/EXEC — a dispatch is the XADDs of
its tasks + the ledger moves to `pending` + the group record + the cursor; an outcome is the
ledger moves + the retry XADD + the group record + the XACK of the trajectory. A kill -9
before EXEC leaves nothing (the trajectory is still pending in our PEL and is handled again),
after EXEC everything; so nothing is lost or dispatched twice.

Who owns which ledger move: the scheduler moves attempts new -> pending, failed/timeout ->
retried | deadlettered, ok -> validated (val); runners move pending -> running and
running -> ok/failed/timeout (atomically with the trajectory XADD); the trainer moves ok ->
trained | filtered:<reason>. Leases of dead runners are reclaimed by the runners themselves
(XAUTOCLAIM), which give up after `runner.max_deliveries` with a failed trajectory, so the
retry/dead-letter decision stays here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from squall.shared import bus, schemas
from squall.shared.config import RunConfig
from squall.shared.keys import EVENTS_MAXLEN, GROUP_SCHEDULER, METRICS_MAXLEN, Keys
from squall.shared.ledger import Ledger
from squall.shared.logs import get_logger

from . import dataset as ds

FAILED_STATUSES = ("failed", "timeout", "cancelled")
HEARTBEAT_EVERY_S = 2.0  # at most; a third of standby_after_s when that is shorter
LEADER_FIELD = "leader_epoch"  # field of Keys.scheduler_state: bumped by each scheduler taking the lead
TRIM_EVERY_S = 10.0  # how often `tasks` and `trajectories` are trimmed past what every group acked


@dataclass
class Cursor:
    """The scheduler's place in the data, persisted in Keys.scheduler_state."""

    epoch: int = 0  # current training epoch
    position: int = 0  # next row of this epoch's order
    group_seq: int = 0  # counter behind group ids
    samples: int = 0  # training samples dispatched so far
    val_round: int = 0  # validation rounds dispatched so far
    last_val_version: int = -1  # trainer version of the last validation round (-1: none yet)
    val_sum: float = 0.0  # reward sum of the open validation round
    val_count: int = 0  # rewards in that sum
    control_id: str = "0-0"  # last Control entry applied
    paused: int = 0
    draining: int = 0
    max_inflight_groups: int = 0  # limits as changed by Control (0: the config's)
    max_staleness: int = -1  # (-1: the config's)
    finished: int = 0  # 1 once a scheduler finished the run (a standby then just exits)

    @classmethod
    def load(cls, r: redis.Redis, keys: Keys) -> Cursor:
        raw = {k.decode(): v.decode() for k, v in r.hgetall(keys.scheduler_state).items()}
        cursor = cls()
        for name, value in raw.items():
            if hasattr(cursor, name):
                current = getattr(cursor, name)
                setattr(cursor, name, type(current)(value))
        return cursor

    def fields(self) -> dict[str, Any]:
        return {k: str(v) for k, v in self.__dict__.items()}


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

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Group:
        return cls(**json.loads(raw))

    @property
    def complete(self) -> bool:
        return all(self.done)


class Scheduler:
    def __init__(self, config: RunConfig, r: redis.Redis) -> None:
        self.config, self.r = config, r
        self.section = config.scheduler
        self.keys = Keys(config.run.name)
        self.ledger = Ledger(r, self.keys)
        self.log = get_logger(component="scheduler")
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        self.splits = self._load_data()
        self.cursor = Cursor()
        self.groups: dict[str, Group] = {}
        self._order: list[int] | None = None
        self.token: int | None = None  # leader epoch once run() took the lead (None: not checked)
        self.lost_lead = False  # step() saw a newer leader epoch
        self._load_state()
        self.consumer = bus.GroupConsumer(
            r,
            self.keys.trajectories,
            GROUP_SCHEDULER,
            "scheduler",  # one scheduler per run: a stable name lets a restart resume its PEL
            kind=schemas.Trajectory,
            deadletter_stream=self.keys.deadletter,
        )
        for stream in (self.keys.tasks,):
            bus.ensure_group(r, stream, "runners")
        self.counts = {
            "dispatched_groups": 0,
            "outcomes": 0,
            "retries": 0,
            "deadlettered": 0,
            "duplicates": 0,
        }
        self._last_heartbeat = 0.0
        self._last_trim = time.monotonic()
        self.started = time.monotonic()

    def _load_state(self) -> None:
        self.cursor = Cursor.load(self.r, self.keys)
        self.groups = {k.decode(): Group.from_json(v) for k, v in self.r.hgetall(self.keys.groups).items()}
        self._order = None

    # --- leadership -----------------------------------------------------------------
    def is_leader(self) -> bool:
        """Still the newest scheduler to take the lead? (Always true outside run().)"""
        if self.token is None:
            return True
        return int(self.r.hget(self.keys.scheduler_state, LEADER_FIELD) or 0) == self.token

    def _other_schedulers(self) -> tuple[str | None, bool]:
        """(a live other scheduler or None, whether some other one may still be around).

        Fresh heartbeat: alive. A heartbeat from this host whose process is gone: dead for
        sure (a local restart after kill -9 need not wait). Anything else stale: presumed dead,
        but a merely paused process could wake up, so the new leader gives it time to notice.
        """
        now, host = time.time(), socket.gethostname()
        live, maybe = None, False
        for raw_name, raw in self.r.hgetall(self.keys.heartbeats).items():
            name = raw_name.decode()
            if not name.startswith("scheduler:") or name == f"scheduler:{self.id}":
                continue
            other_host, _, pid = name.removeprefix("scheduler:").rpartition("-")
            if other_host == host and pid.isdigit() and not _pid_alive(int(pid)):
                self.r.hdel(self.keys.heartbeats, name)
                continue
            try:
                age = now - float(json.loads(raw)["time"])
            except (ValueError, TypeError, KeyError):
                age = float("inf")
            if age < self.section.standby_after_s:
                live = name
            maybe = True
        return live, maybe

    def acquire(self, stopped) -> bool:
        """Wait as a standby while another scheduler is alive, then take the lead: bump the
        leader epoch, give a possibly paused former leader time to see it, load the state."""
        waited = time.monotonic()
        live, maybe = self._other_schedulers()
        if live:
            self.log.info("scheduler_standby", leader=live, takes_over_after_s=self.section.standby_after_s)
        while live:
            if stopped():
                return False
            time.sleep(0.5)
            live, maybe = self._other_schedulers()
        self.token = int(self.r.hincrby(self.keys.scheduler_state, LEADER_FIELD, 1))
        self._last_heartbeat = 0.0
        self._heartbeat(self.trainer_version())
        if maybe:
            time.sleep(2 * self.section.poll_s + 0.2)  # a former leader checks the epoch every step
            if not self.is_leader():
                return False
        self._load_state()
        self.log.info("scheduler_leading", leader_epoch=self.token, waited_s=round(time.monotonic() - waited, 3),
                      open_groups=len(self.groups))  # fmt: skip
        return True

    # --- data ----------------------------------------------------------------
    def _load_data(self) -> ds.Splits:
        train = ds.load_rows(self.section.dataset) if self.section.dataset else []
        val = ds.load_rows(self.section.val_dataset) if self.section.val_dataset else None
        return ds.split(train, val, self.section.val_fraction, self.config.run.seed)

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = ds.epoch_order(
                len(self.splits.train), self.cursor.epoch, self.config.run.seed, self.section.shuffle
            )
        return self._order

    @property
    def exhausted(self) -> bool:
        if self.section.max_samples and self.cursor.samples >= self.section.max_samples:
            return True
        return self.cursor.epoch >= self.section.epochs or not self.splits.train

    def _advance(self, cursor: Cursor) -> None:
        cursor.position += 1
        if cursor.position >= len(self.splits.train):
            cursor.epoch, cursor.position = cursor.epoch + 1, 0
            self._order = None

    # --- versions and admission -------------------------------------------------
    def trainer_version(self) -> int:
        raw = self.r.hget(self.keys.versions, "trainer")
        return int(raw) if raw is not None else 0

    @property
    def max_inflight(self) -> int:
        limit = self.cursor.max_inflight_groups or self.section.max_inflight_groups
        if self.section.hold_until_trained:
            # Held groups wait for a trainer step; fewer than one step's worth would deadlock.
            limit = max(limit, self.config.trainer.groups_per_step)
        return limit

    @property
    def max_staleness(self) -> int:
        return self.cursor.max_staleness if self.cursor.max_staleness >= 0 else self.section.max_staleness

    def admits(self, version: int) -> bool:
        """May one more training group go out now? (Held groups count: see hold_until_trained.)"""
        train = [g for g in self.groups.values() if g.mode == "train"]
        if len(train) >= self.max_inflight:
            return False
        # Staleness is bounded by groups still rolling out. A rolled-out group held for the
        # trainer only waits for one more step's worth of groups (or is filtered as stale
        # there): counting it here would block exactly the dispatch that step waits for.
        oldest = min((g.version for g in train if not g.rolled_out), default=version)
        return version - oldest <= self.max_staleness

    # --- dispatch -------------------------------------------------------------------
    def _tasks_for(self, group: Group, members: range | list[int], version: int) -> list[schemas.Task]:
        now = time.time()
        return [
            schemas.Task(
                run=self.keys.run,
                task_id=f"{group.group_id}:{i}",
                group_id=group.group_id,
                sample_id=group.sample_id,
                index=i,
                group_size=group.size,
                attempt=group.attempts[i],
                mode=group.mode,  # type: ignore[arg-type]
                payload=group.payload,
                min_version=version,
                deadline=now + self.section.task_timeout_s,
                epoch=group.epoch,
                created_at=now,
            )
            for i in members
        ]

    def _new_group(self, cursor: Cursor, sample: ds.Sample, mode: str, size: int, version: int) -> Group:
        group_id = (
            f"g{cursor.group_seq:07d}"
            if mode == "train"
            else f"v{cursor.val_round:04d}-{cursor.group_seq:07d}"
        )
        cursor.group_seq += 1
        return Group(
            group_id=group_id,
            sample_id=sample.sample_id,
            mode=mode,
            version=version,
            size=size,
            epoch=cursor.epoch if mode == "train" else -1,
            created=time.time(),
            payload=sample.row,
            attempts=[0] * size,
            done=[False] * size,
            rewards=[None] * size,
        )

    def _commit_dispatch(self, groups: list[Group], cursor: Cursor, version: int) -> None:
        """XADD every task, ledger -> pending, group records and cursor: one MULTI/EXEC."""
        pipe = self.r.pipeline(transaction=True)
        keys = []
        for group in groups:
            for task in self._tasks_for(group, range(group.size), version):
                pipe.xadd(self.keys.tasks, {schemas.ENTRY_FIELD: schemas.encode(task)})
                keys.append(task.key)
            pipe.hset(self.keys.groups, group.group_id, group.to_json())
        self.ledger.move_in(pipe, keys, "pending", allowed_from=("new",))
        pipe.hset(self.keys.scheduler_state, mapping=cursor.fields())
        pipe.execute()
        self.cursor = cursor
        for group in groups:
            self.groups[group.group_id] = group
        self.counts["dispatched_groups"] += len(groups)

    def dispatch_train(self, version: int) -> bool:
        """Dispatch the next training sample as a group; False when none may go out now."""
        if self.cursor.paused or self.cursor.draining or self.exhausted or not self.admits(version):
            return False
        if not self.is_leader():
            return False
        cursor = Cursor(**self.cursor.__dict__)
        sample = self.splits.train[self._epoch_order()[cursor.position]]
        group = self._new_group(cursor, sample, "train", self.section.group_size, version)
        cursor.samples += 1
        self._advance(cursor)
        self._commit_dispatch([group], cursor, version)
        self.log.debug(
            "group_dispatched", group_id=group.group_id, sample_id=group.sample_id, version=version
        )
        return True

    def maybe_validate(self, version: int) -> bool:
        """Dispatch a validation round every `val_every` versions (one round open at a time)."""
        if not self.section.val_every or not self.splits.val or self.cursor.paused or self.cursor.draining:
            return False
        if any(g.mode == "val" for g in self.groups.values()):
            return False
        last = self.cursor.last_val_version
        # Out of training data: one last round on the newest version, so a run ends measured.
        final = self.section.val_at_end and self.exhausted and version > last
        if last >= 0 and version < last + self.section.val_every and not final:
            return False
        cursor = Cursor(**self.cursor.__dict__)
        cursor.val_round += 1
        cursor.last_val_version = version
        cursor.val_sum, cursor.val_count = 0.0, 0
        samples = self.splits.val[: self.section.val_samples or None]
        groups = [self._new_group(cursor, s, "val", self.section.val_group_size, version) for s in samples]
        self._commit_dispatch(groups, cursor, version)
        self._event("val_round_dispatched", round=cursor.val_round, version=version, groups=len(groups))
        return True

    # --- outcomes -------------------------------------------------------------------
    def handle(self, delivery: bus.Delivery) -> None:
        traj: schemas.Trajectory = delivery.message
        if not self.is_leader():
            # Deposed (e.g. paused past standby_after_s): our in-memory groups are stale; the
            # entry stays pending under the shared consumer name for the leader to handle.
            self.lost_lead = True
            return
        group = self.groups.get(traj.group_id)
        index = traj.index
        current = group is not None and 0 <= index < group.size and group.attempts[index] == traj.attempt
        if not current or group is None or group.done[index]:
            # A late or repeated trajectory: counted once already (or by its successor).
            self.counts["duplicates"] += 1
            self.consumer.ack([delivery.entry_id])
            return
        self.counts["outcomes"] += 1
        pipe = self.r.pipeline(transaction=True)
        if traj.status == "ok":
            group.done[index], group.rewards[index] = True, traj.reward
            if group.mode == "val":
                self.ledger.move_in(pipe, [traj.key], "validated", allowed_from=("ok",))
        elif traj.attempt + 1 < self.section.max_attempts:
            group.attempts[index] = traj.attempt + 1
            self.ledger.move_in(pipe, [traj.key], "retried", allowed_from=FAILED_STATUSES)
            (task,) = self._tasks_for(group, [index], self.trainer_version())
            pipe.xadd(self.keys.tasks, {schemas.ENTRY_FIELD: schemas.encode(task)})
            self.ledger.move_in(pipe, [task.key], "pending", allowed_from=("new",))
            self.counts["retries"] += 1
            self.log.info(
                "attempt_retried",
                task_id=traj.task_id,
                attempt=task.attempt,
                status=traj.status,
                error=traj.error,
            )
        else:
            group.done[index] = True
            self.ledger.move_in(pipe, [traj.key], "deadlettered", allowed_from=FAILED_STATUSES)
            reason = f"{traj.task_id}: {traj.status} in all {self.section.max_attempts} attempts; last error: {traj.error}"
            pipe.xadd(
                self.keys.deadletter,
                {"source": self.keys.trajectories, "id": delivery.entry_id, "group": GROUP_SCHEDULER,
                 "reason": reason[:2000], "raw": schemas.encode(traj)},
            )  # fmt: skip
            self.counts["deadlettered"] += 1
            self.log.warning(
                "attempt_deadlettered",
                task_id=traj.task_id,
                attempts=self.section.max_attempts,
                error=traj.error,
            )
        hold = group.complete and group.mode == "train" and self.section.hold_until_trained
        if group.complete:
            group.rolled_out = hold
            self._settle_group(pipe, group)
        if hold or not group.complete:
            pipe.hset(self.keys.groups, group.group_id, group.to_json())
        pipe.xack(self.keys.trajectories, GROUP_SCHEDULER, delivery.entry_id)
        pipe.execute()
        if group.complete and not hold:
            self.groups.pop(group.group_id, None)
        if group.complete and group.mode == "val" and not any(g.mode == "val" for g in self.groups.values()):
            self._close_val_round()

    def _settle_group(self, pipe: redis.client.Pipeline, group: Group) -> None:
        if not group.rolled_out:
            pipe.hdel(self.keys.groups, group.group_id)
        rewards = [x for x in group.rewards if x is not None]
        mean = sum(rewards) / len(rewards) if rewards else None
        if group.mode == "val":
            self.cursor.val_sum += sum(rewards)
            self.cursor.val_count += len(rewards)
            pipe.hset(
                self.keys.scheduler_state,
                mapping={"val_sum": str(self.cursor.val_sum), "val_count": str(self.cursor.val_count)},
            )
            return
        if mean is not None:
            pipe.xadd(
                self.keys.rewards,
                {"version": group.version, "mode": "train", "mean": mean, "count": len(rewards),
                 "group_id": group.group_id, "time": time.time()},
                maxlen=METRICS_MAXLEN, approximate=True,
            )  # fmt: skip

    def _close_val_round(self) -> None:
        count = self.cursor.val_count
        mean = self.cursor.val_sum / count if count else float("nan")
        version = self.cursor.last_val_version
        self.r.xadd(
            self.keys.rewards,
            {"version": version, "mode": "val", "mean": mean, "count": count,
             "group_id": f"round{self.cursor.val_round}", "time": time.time()},
            maxlen=METRICS_MAXLEN, approximate=True,
        )  # fmt: skip
        self._event("val_reward", round=self.cursor.val_round, version=version, mean=mean, count=count)
        self.log.info(
            "val_round_done", round=self.cursor.val_round, version=version, mean_reward=mean, count=count
        )

    # --- control ----------------------------------------------------------------------
    def apply_control(self) -> None:
        reply = self.r.xread({self.keys.control: self.cursor.control_id}, count=100)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                entry_id = entry_id.decode()
                try:
                    message = schemas.decode(fields.get(schemas.ENTRY_FIELD, b""), schemas.Control)
                except Exception as exc:
                    bus.dead_letter(self.r, self.keys.deadletter, source=self.keys.control, entry_id=entry_id,
                                    reason=str(exc), raw=fields.get(schemas.ENTRY_FIELD))  # fmt: skip
                    message = None
                if message is not None:
                    self._apply(message)
                self.cursor.control_id = entry_id
                self.r.hset(self.keys.scheduler_state, mapping=self.cursor.fields())

    def _apply(self, control: schemas.Control) -> None:
        if control.action == "pause":
            self.cursor.paused = 1
        elif control.action == "resume":
            self.cursor.paused, self.cursor.draining = 0, 0
        elif control.action == "drain":
            self.cursor.draining = 1
        elif control.action == "limits":
            if "max_inflight_groups" in control.limits:
                self.cursor.max_inflight_groups = max(1, int(control.limits["max_inflight_groups"]))
            if "max_staleness" in control.limits:
                self.cursor.max_staleness = max(0, int(control.limits["max_staleness"]))
        self._event("control", action=control.action, limits=control.limits)
        self.log.info("control_applied", action=control.action, limits=control.limits)

    # --- loop ---------------------------------------------------------------------------
    def _event(self, name: str, **fields: Any) -> None:
        event = schemas.Event(run=self.keys.run, service="scheduler", name=name, fields=fields)
        bus.publish(self.r, self.keys.events, event, maxlen=EVENTS_MAXLEN)

    def _trim(self) -> None:
        """Drop entries of `tasks`/`trajectories` that every consumer group has acknowledged."""
        now = time.monotonic()
        if now - self._last_trim < TRIM_EVERY_S:
            return
        self._last_trim = now
        for stream in (self.keys.tasks, self.keys.trajectories):
            bus.trim_acknowledged(self.r, stream, self.keys.groups_of(stream))

    def _heartbeat(self, version: int) -> None:
        now = time.time()
        if now - self._last_heartbeat < min(HEARTBEAT_EVERY_S, self.section.standby_after_s / 3):
            return
        self._last_heartbeat = now
        body = {"time": now, "version": version, "open_groups": len(self.groups), **self.counts,
                "epoch": self.cursor.epoch, "samples": self.cursor.samples}  # fmt: skip
        self.r.hset(self.keys.heartbeats, f"scheduler:{self.id}", json.dumps(body))

    @property
    def finished(self) -> bool:
        """Out of data (or drained) and every group rolled out; held groups are the trainer's now."""
        rolling = any(not g.rolled_out for g in self.groups.values())
        if self.cursor.draining:
            return not rolling
        return self.exhausted and not rolling and not self._final_val_due()

    def _final_val_due(self) -> bool:
        """A last validation round is owed on the newest version (see maybe_validate)."""
        if not (self.section.val_at_end and self.section.val_every and self.splits.val):
            return False
        return self.cursor.last_val_version < self.trainer_version()

    def release_trained(self) -> int:
        """Drop held groups whose ok members the trainer has consumed (no attempt left in `ok`)."""
        held = [g for g in self.groups.values() if g.rolled_out]
        if not held:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for group in held:
            for i, attempt in enumerate(group.attempts):  # HGETs, not HMGET: the ACL grants HGET
                pipe.hget(self.keys.attempts, f"{group.group_id}:{i}#{attempt}")
        states = iter(pipe.execute())
        released = [g for g in held if b"ok" not in [next(states) for _ in g.attempts]]
        if released:
            self.r.hdel(self.keys.groups, *[g.group_id for g in released])
            for group in released:
                self.groups.pop(group.group_id, None)
        return len(released)

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
        if self.finished:
            self._finish()
            return False
        self._heartbeat(version)
        self._trim()
        # Entries still pending under our (shared) consumer name were left by a crash or by a
        # deposed leader that read them after losing the lead: handling is idempotent.
        left = self.consumer.read(count=256, own_pending=True)
        for delivery in left or self.consumer.read(count=256, block_ms=int(self.section.poll_s * 1000)):
            self.handle(delivery)
        return not self.lost_lead

    def run(self) -> int:
        from prometheus_client import REGISTRY
        from squall.ops.health import start_health_server
        from squall.ops.metrics import QueueCollector

        REGISTRY.register(QueueCollector(self.r, self.keys))
        health, port = start_health_server(self.section.metrics_host, self.section.metrics_port,
                                           info=lambda: {"open_groups": len(self.groups)})  # fmt: skip
        try:
            return self._run(port)
        finally:
            health.close()

    def _run(self, metrics_port: int) -> int:
        stop = {"signal": 0}
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stop.update(signal=signum))

        def stopped() -> bool:
            return bool(stop["signal"])

        while not stopped():
            if not self.acquire(stopped):
                continue  # stopped while standing by, or another scheduler won the race
            if self.cursor.finished and self.finished:
                self.log.info("scheduler_already_finished", samples=self.cursor.samples)
                return 0
            self.started = time.monotonic()
            self.log.info("scheduler_started", train=len(self.splits.train), val=len(self.splits.val),
                          metrics_port=metrics_port, open_groups=len(self.groups), epoch=self.cursor.epoch,
                          position=self.cursor.position, leader_epoch=self.token)  # fmt: skip
            self._event(
                "started", open_groups=len(self.groups), samples=self.cursor.samples, leader_epoch=self.token
            )
            for delivery in self.consumer.read(count=10_000, own_pending=True):  # left by a crash
                self.handle(delivery)
            self.lost_lead = False
            while not stopped() and self.step():
                pass
            if self.lost_lead:
                self.log.warning("scheduler_lost_lead", leader_epoch=self.token, **self.counts)
                continue  # a newer scheduler leads now: stand by behind it
            if not stopped():
                return 0  # finished
        # Everything is already in Redis (each step is one transaction): a restart resumes here.
        self.r.hdel(self.keys.heartbeats, f"scheduler:{self.id}")
        self._event("stopped", signal=stop["signal"], open_groups=len(self.groups))
        self.log.info("scheduler_stopped", signal=stop["signal"], open_groups=len(self.groups), **self.counts)
        return 0

    def _finish(self) -> None:
        reason = "drained" if self.cursor.draining else "dataset_exhausted"
        self.cursor.finished = 1
        self.r.hset(self.keys.scheduler_state, "finished", "1")
        self._event("finished", reason=reason, samples=self.cursor.samples, **self.counts)
        self.r.hdel(self.keys.heartbeats, f"scheduler:{self.id}")
        self.log.info("scheduler_finished", reason=reason, samples=self.cursor.samples,
                      seconds=round(time.monotonic() - self.started, 3), **self.counts)  # fmt: skip


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True

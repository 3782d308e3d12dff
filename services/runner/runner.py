"""The runner: K slots executing task attempts with the user's agent, behind a local gateway.

Parts (wired here):
- fetch loop   one blocking XREADGROUP (group `runners`, a consumer name unique to this
               process) asking only for as many tasks as there are free slots, plus
               XAUTOCLAIM of entries whose lease lapsed (their runner died);
- lease loop   renews the entries of running attempts (GroupConsumer.renew); an attempt
               whose entry another runner reclaimed is cancelled and never published;
- attempt      ledger move `take` (pending -> running), agent under the task's deadline,
               reward, then `finish`: ONE Lua script that checks we still own the entry, XADDs
               the Trajectory, XACKs the task and makes the ledger move `finish_<status>`
               (built from shared.ledger's move function and table). So an attempt produces
               exactly one trajectory even across kills and reclaims;
- `agents`     the agent contract and the reward; `gateway` the local LLM endpoint;
- `trainwatch` a `train_agents` entry no call uses is recorded once per run (shared.runwarnings)
               and logged by the runner whose record went in;
- heartbeat    `runner:<id>` in Keys.heartbeats every `heartbeat_s`, marked stopped at a clean
               exit (shared.heartbeat).
An entry delivered more than `max_deliveries` times (runners kept dying on it) finishes as
failed without running; the scheduler then retries or dead-letters it.
A Redis outage pauses every loop and every finish until Redis answers again (shared.retry,
one wait shared by all of them, logged and counted as squall_errors_total{kind="redis_outage"});
past `run.redis_outage_s` the runner cancels its attempts and exits non-zero naming the URL.
SIGTERM: stop taking tasks, let running attempts finish within `grace_s`, then cancel the
rest and hand their entries back at once (their idle time is set past the lease, so the next
runner's XAUTOCLAIM takes them), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import REGISTRY

from squall.monitor.health import start_health_server
from squall.monitor.metrics import standard_metrics
from squall.shared import bus, schemas
from squall.shared.config import RunConfig
from squall.shared.errors import AgentError, RedisUnavailable, SchemaError
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import GROUP_RUNNERS, Keys
from squall.shared.ledger import FINISH_BY_STATUS, Ledger, lua_move_function, lua_sources
from squall.shared.logs import get_logger
from squall.shared.resources import ResourceCache, ResourceError
from squall.shared.retry import REDIS_ERRORS, RedisOutage
from squall.shared.roleplan import roles_of
from squall.shared.runwarnings import AGENT_FAILING, TRAIN_AGENT_UNUSED, RunWarning, record_once
from squall.tracking.otel import attempt_ids, call_span_id, traceparent, tracer_for

from .agents import LLM, CommandAgent, PythonAgent, load_callable, resolve_reward
from .failwatch import AgentFailureWatch
from .gateway import Gateway
from .rolerewards import split_role_rewards
from .trainwatch import TrainAgentsWatch
from .turn_rewards import attach_reward, emitted_total

READ_BLOCK_MS = 1000  # longest XREADGROUP block: how soon the fetch loop notices a stop
FULL_WAIT_S = 1.0  # longest wait for a free slot when all are busy (also how soon it notices a stop)
REDIS_RETRY_S = 1.0  # pause of a loop after a Redis command error (not an outage) before it retries

# KEYS: tasks, trajectories, attempts, ledger. ARGV: group, consumer, entry id, trajectory
# bytes, attempt key, target state (FINISH_BY_STATUS[status]'s). Returns 1 when published, 0
# when the entry is no longer ours. SOURCES: target state -> the states that move may start from.
_FINISH_BODY = """
local SOURCES = %s
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not p[1] or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XADD', KEYS[2], '*', 'm', ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
squall_move(KEYS[3], KEYS[4], ARGV[5], ARGV[6], SOURCES[ARGV[6]])
return 1
"""


def finish_script() -> str:
    """The finish script: the ledger's move function, its finish moves' sources, the body."""
    sources = ", ".join(
        f"['{move.target_state()}']={lua_sources(move.sources)}" for move in FINISH_BY_STATUS.values()
    )
    return lua_move_function() + _FINISH_BODY % ("{" + sources + "}")


_FINISH = finish_script()


@dataclass
class Running:
    """One attempt in a slot."""

    task: schemas.Task
    entry_id: str
    job: asyncio.Task
    lost: bool = False  # another runner reclaimed our entry: drop the result


class Runner:
    def __init__(self, config: RunConfig, r: redis.Redis, agent: PythonAgent | CommandAgent) -> None:
        self.config, self.r, self.agent = config, r, agent
        self.section = config.runner
        self.keys = Keys(config.run.name)
        self.ledger = Ledger(r, self.keys)
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.log = get_logger(component="runner", runner_id=self.id)
        self.consumer = bus.GroupConsumer(
            r,
            self.keys.tasks,
            GROUP_RUNNERS,
            self.id,
            kind=schemas.Task,
            deadletter_stream=self.keys.deadletter,
        )
        self.reward_fn = (
            load_callable(self.section.reward_fn, "reward_fn") if self.section.reward_fn else None
        )
        roles = [role for role in roles_of(config) if role.declared]
        self.role_names = [role.name for role in roles]  # empty: the single-policy run
        agent_roles = {agent: role.name for role in roles for agent in role.agents}
        self.gateway = Gateway(self.section, config.model.name, agent_roles if roles else None)
        self.tracer = tracer_for(config, "runner", metrics=REGISTRY)
        self._finish = r.register_script(_FINISH)
        self.resource_cache = ResourceCache(r, self.keys)
        self.heartbeat = HeartbeatWriter(r, self.keys, "runner", self.id, every_s=self.section.heartbeat_s)
        self.outage = RedisOutage(
            config.run.redis_url, config.run.redis_outage_s, log=self.log, on_outage=self._count_outage
        )
        self._outage_wait: asyncio.Future | None = None  # the one wait every loop shares
        self.fatal: RedisUnavailable | None = None  # Redis stayed away past the deadline
        self.seen_version = -1  # newest weight version seen in a trajectory's turns
        self.train_watch = TrainAgentsWatch(self.section.train_agents, self.section.train_agents_check_after)
        self.fail_watch = AgentFailureWatch(self.section.agent_failing_after)
        self.running: dict[str, Running] = {}  # entry id -> attempt
        self.stopping = asyncio.Event()
        self.slot_freed = asyncio.Event()  # set when an attempt ends: the fetch loop may read again
        self.counts = {
            "ok": 0,
            "failed": 0,
            "timeout": 0,
            "skipped": 0,
            "lost": 0,
            "handed_back": 0,
            "reclaimed": 0,
        }
        self._last_reclaim = 0.0
        self.metrics = standard_metrics()
        self._dead_seen = 0  # malformed task entries already counted in metrics
        self.metrics_port = 0

    # --- main -----------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        port = await self.gateway.start()
        health, metrics_port = start_health_server(
            self.section.gateway_host,
            self.section.metrics_port,
            ready=lambda: not self.stopping.is_set(),
            api_key=self.section.api_key,
            info=lambda: {"runner_id": self.id, "busy": len(self.running)},
        )
        self.metrics_port = metrics_port
        self.log.info(
            "runner_started",
            agent=self.agent.spec,
            slots=self.section.concurrency,
            gateway_port=port,
            metrics_port=metrics_port,
        )
        loops = [
            asyncio.create_task(self._fatal_on_outage(loop()))
            for loop in (self._fetch_loop, self._lease_loop, self._heartbeat_loop)
        ]
        await self.stopping.wait()
        started = time.monotonic()
        self.log.info("runner_stopping", in_flight=len(self.running), grace_s=self.section.grace_s)
        await self._drain()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await self.gateway.stop()
        health.close()
        self.tracer.close()
        if self.tracer.dropped:
            self.log.warning("otel_spans_dropped", spans=self.tracer.dropped)
        if self.fatal is not None:
            raise self.fatal  # Redis is gone: no heartbeat to mark, no entry to hand back
        await asyncio.to_thread(self.heartbeat.stop, busy=0)
        self.log.info("runner_stopped", seconds=round(time.monotonic() - started, 3), **self.counts)
        return 0

    async def _drain(self) -> None:
        """Let running attempts finish within the grace period, then cancel and hand back the rest
        (at once, without grace, when Redis is gone: nothing could be published)."""
        jobs = [a.job for a in self.running.values()]
        if jobs and self.fatal is None:
            await asyncio.wait(jobs, timeout=self.section.grace_s)
        leftover = list(self.running.values())
        for attempt in leftover:
            attempt.job.cancel()
        if leftover:
            await asyncio.wait([a.job for a in leftover], timeout=5)
            if self.fatal is None:
                self._hand_back([a.entry_id for a in leftover])

    def _hand_back(self, entry_ids: list[str]) -> None:
        """Make entries immediately reclaimable: idle time past the lease, delivery count kept."""
        idle_ms = int(self.section.lease_s * 1000) * 10
        self.r.xclaim(self.keys.tasks, GROUP_RUNNERS, self.id, 0, entry_ids, idle=idle_ms, justid=True)
        self.counts["handed_back"] += len(entry_ids)

    # --- Redis outages ---------------------------------------------------------------------
    def _count_outage(self) -> None:
        self.metrics.errors.labels(kind="redis_outage").inc()

    async def _ride_out(self, error: BaseException, where: str) -> None:
        """Wait for Redis to answer again, together with every other loop that hit the outage
        (one wait, so one outage is logged and counted once); RedisUnavailable past the deadline."""
        if self._outage_wait is None or self._outage_wait.done():
            wait = self.outage.wait_async(_Pinger(self.r), error, where)
            self._outage_wait = asyncio.ensure_future(wait)
        await asyncio.shield(self._outage_wait)

    async def _call(self, where: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a thread, repeated after a Redis outage: every caller's call
        is safe to repeat (a read, an idempotent ledger move, an XACK, the finish script)."""
        while True:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except REDIS_ERRORS as exc:
                await self._ride_out(exc, where)

    async def _fatal_on_outage(self, work: Any) -> None:
        """Run a loop or an attempt; if Redis stays away past the deadline, stop the runner."""
        try:
            await work
        except RedisUnavailable as exc:
            if self.fatal is None:
                self.fatal = exc
                self.log.error("redis_unavailable", error=str(exc), in_flight=len(self.running))
            self.stopping.set()

    async def _guarded(self, step, what: str) -> None:
        """Run one loop step; an outage waits for Redis, any other Redis error is logged,
        counted and retried after a pause, never fatal to the loop."""
        try:
            await step()
        except REDIS_ERRORS as exc:
            await self._ride_out(exc, what)
        except redis.RedisError as exc:
            self.log.warning("redis_error", loop=what, error=str(exc), retry_in_s=REDIS_RETRY_S)
            self.metrics.errors.labels(kind="redis").inc()
            await asyncio.sleep(REDIS_RETRY_S)

    async def _fetch_loop(self) -> None:
        while not self.stopping.is_set():
            await self._guarded(self._fetch_once, "fetch")

    async def _fetch_once(self) -> None:
        lease_ms = int(self.section.lease_s * 1000)
        free = self.section.concurrency - len(self.running)
        if free <= 0:  # every slot busy: wait for one to free up (or the deadline), never spin
            self.slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.slot_freed.wait(), FULL_WAIT_S)
            return
        deliveries: list[bus.Delivery] = []
        if time.monotonic() - self._last_reclaim > self.section.lease_s / 2:
            self._last_reclaim = time.monotonic()
            deliveries = await asyncio.to_thread(self.consumer.reclaim, lease_ms, free)
            self.counts["reclaimed"] += sum(1 for d in deliveries if d.entry_id not in self.running)
        if not deliveries:
            deliveries = await asyncio.to_thread(self.consumer.read, free, READ_BLOCK_MS)
        for delivery in deliveries:
            if delivery.entry_id in self.running:
                continue  # our own attempt, reclaimed after an outage outlasted its lease: keep it
            if self.stopping.is_set():
                await asyncio.to_thread(self._hand_back, [delivery.entry_id])
                continue
            job = asyncio.create_task(self._fatal_on_outage(self._attempt(delivery)))
            self.running[delivery.entry_id] = Running(delivery.message, delivery.entry_id, job)
            job.add_done_callback(lambda _, e=delivery.entry_id: self._attempt_ended(e))

    def _attempt_ended(self, entry_id: str) -> None:
        self.running.pop(entry_id, None)
        self.slot_freed.set()

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.section.lease_s / 3)
            await self._guarded(self._renew_once, "lease")

    async def _renew_once(self) -> None:
        ids = list(self.running)
        if not ids:
            return
        owned = set(await asyncio.to_thread(self.consumer.renew, ids))
        for entry_id in ids:
            attempt = self.running.get(entry_id)
            if entry_id not in owned and attempt is not None:
                attempt.lost = True
                attempt.job.cancel()
                self.counts["lost"] += 1
                self.log.warning("lease_lost", task_id=attempt.task.task_id, attempt=attempt.task.attempt)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._guarded(self._heartbeat_once, "heartbeat")
            await asyncio.sleep(self.section.heartbeat_s)

    async def _heartbeat_once(self) -> None:
        await asyncio.to_thread(
            self.heartbeat.beat,
            force=True,
            version=self.seen_version,
            metrics_port=self.metrics_port,
            slots=self.section.concurrency,
            busy=len(self.running),
            gateway_port=self.gateway.port,
            **self.counts,
            continuity_breaks=self.gateway.continuity_breaks,
            context_overflows=self.gateway.context_overflows,
        )

    # --- one attempt ----------------------------------------------------------------------
    async def _time_to_run(self, delivery: bus.Delivery, task: schemas.Task, taken: float) -> float | None:
        """Take the attempt and return the seconds it may run; None when it must not start
        (delivered too often, already finished, or its deadline passed in the queue): then its
        outcome is already published or acknowledged."""
        if delivery.deliveries > self.section.max_deliveries:
            error = (
                f"delivered {delivery.deliveries} times without finishing (lease of {self.section.lease_s}s "
                "lapsed each time: runners died or hung on it); giving up on this attempt"
            )
            await self._publish(delivery, self._trajectory(task, "failed", error=error), taken)
            return None
        state = await self._call("attempt", self.ledger.state_of, task.key)
        if state not in (None, "pending", "running"):
            # Already finished (or cancelled) — e.g. handed back after its trajectory went out.
            await self._call("attempt", self.consumer.ack, [delivery.entry_id])
            self.counts["skipped"] += 1
            return None
        await self._call("attempt", self.ledger.apply, "take", [task.key])
        if task.not_before > time.time():  # an infrastructure retry's backoff (scheduler outcomes)
            await asyncio.sleep(min(task.not_before, task.deadline) - time.time())
        remaining = task.deadline - time.time()
        if remaining <= 0:
            error = f"deadline passed {-remaining:.1f}s before the attempt started (waited in the queue)"
            await self._publish(delivery, self._trajectory(task, "timeout", error=error), taken)
            return None
        if task.run_timeout_s > 0:  # the attempt's own deadline starts now: queue time not counted
            remaining = task.run_timeout_s
        return remaining

    async def _attempt(self, delivery: bus.Delivery) -> None:
        task: schemas.Task = delivery.message
        taken = time.time()
        remaining = await self._time_to_run(delivery, task, taken)
        if remaining is None:
            return
        attempt = self.gateway.open(task.key, task.min_version, task.group_id)
        root = self.gateway.base_url(attempt.token).removesuffix("/v1")
        trace_id, span_id = attempt_ids(self.keys.run, task.key)
        try:
            texts = await self._resource_texts(task)
        except ResourceError as exc:
            self.gateway.close(attempt.token)
            await self._publish(delivery, self._trajectory(task, "failed", error=str(exc)), taken)
            return
        llm = LLM(
            resources=texts,
            resource_versions=dict(task.resources),
            base_url=f"{root}/v1",
            model=self.config.model.name,
            api_key=f"squall-{attempt.token}",
            _root=root,
            traceparent=traceparent(trace_id, span_id) if self.tracer.enabled else "",
            _on_reward=lambda value: attach_reward(attempt.turns, value),
        )
        began = time.time()
        if self.tracer.enabled:
            attempt.trace_parent = lambda i: traceparent(trace_id, call_span_id(self.keys.run, task.key, i))
        status, reward, error = "ok", None, None
        role_rewards: dict[str, float] = {}
        agent_started = time.perf_counter()
        deadline = asyncio.timeout(remaining)
        try:
            async with deadline:  # the reward function runs under the attempt's deadline too
                returned = await self.agent(task.payload, llm)
                if attempt.error:
                    raise AgentError(attempt.error)
                returned, role_rewards = split_role_rewards(returned, self.role_names)
                reward = await resolve_reward(
                    returned,
                    llm,
                    self.reward_fn,
                    task.payload,
                    attempt.final_answer,
                    emitted_total(attempt.turns),
                )
        except TimeoutError as exc:
            if deadline.expired():
                status, error = (
                    "timeout",
                    f"agent (or its reward) ran past the deadline ({remaining:.1f}s left at start); cancelled",
                )
            else:
                status, error = "failed", f"TimeoutError: {exc}"
        except asyncio.CancelledError:
            self.gateway.close(attempt.token)
            raise  # lease lost or shutting down: no trajectory, the entry goes to another runner
        except Exception as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"[:4000]
        agent_s = time.perf_counter() - agent_started
        self.gateway.close(attempt.token)
        timings = {"queue": max(0.0, taken - task.created_at), "agent": agent_s, "llm": attempt.llm_s}
        # A failure while no policy node answered is the infrastructure's, not the agent's; so
        # is a deadline that passed while a policy call was still waiting on inference.
        infra = attempt.infra if status != "ok" else ""
        if status == "timeout" and not infra and attempt.waiting:
            infra = "deadline"
        trajectory = self._trajectory(
            task,
            status,
            reward=reward,
            error=error,
            turns=attempt.turns,
            timings=timings,
            final_answer=attempt.final_answer,
            infra=infra,
            role_rewards=role_rewards if status == "ok" else {},
        )
        self.tracer.attempt(trajectory, began, time.time(), attempt.call_starts)
        await self._publish(delivery, trajectory, taken)

    async def _resource_texts(self, task: schemas.Task) -> dict[str, str]:
        """The texts of the resource versions the task pinned (shared/resources.py), each read
        from Redis once per runner; ResourceError when one cannot be had."""
        if not task.resources:
            return {}
        return await self._call("attempt", self.resource_cache.texts_for, task.resources)

    def _observe(self, trajectory: schemas.Trajectory, taken: float) -> None:
        """Prometheus: the standard squall metrics (names in squall.monitor.metrics)."""
        self.metrics.attempts.labels(status=trajectory.status).inc()
        self.metrics.rollout_seconds.labels(mode=trajectory.mode).observe(time.time() - taken)
        self.metrics.inflight.set(len(self.running) - 1)
        for turn in trajectory.turns:
            self.metrics.tokens.labels(kind="prompt").inc(len(turn.prompt_ids) // 4)
            self.metrics.tokens.labels(kind="response").inc(len(turn.response_ids) // 4)
            if turn.trained and turn.version >= 0:  # a frozen opponent's version is not the policy's
                self.metrics.weight_version.labels(role="seen").set(turn.version)
                self.seen_version = max(self.seen_version, turn.version)
        dead = self.consumer.dead_lettered - self._dead_seen
        if dead:
            self.metrics.deadlettered.labels(source="tasks").inc(dead)
            self._dead_seen += dead

    async def _watch(self, trajectory: schemas.Trajectory) -> None:
        """The run warnings a finished attempt can complete: a `train_agents` name no call used,
        an agent that fails every attempt."""
        for name in self.train_watch.observe(trajectory.turns):
            await self._warn_once(
                RunWarning(TRAIN_AGENT_UNUSED, name, self.train_watch.message(name), time.time(), f"runner:{self.id}"),
                "train_agent_unused", agent=name, attempts=self.train_watch.attempts,
            )  # fmt: skip
        if self.fail_watch.observe(trajectory.status, trajectory.infra, trajectory.error):
            agent = self.section.agent or self.section.agent_cmd
            await self._warn_once(
                RunWarning(AGENT_FAILING, agent, self.fail_watch.message(agent), time.time(), f"runner:{self.id}"),
                "agent_failing", agent=agent, in_a_row=self.fail_watch.in_a_row,
            )  # fmt: skip

    async def _warn_once(self, warning: RunWarning, event: str, **fields: Any) -> None:
        """Record `warning` once per run; the runner whose record went in logs it (a Redis that
        refuses the record still gets it logged here)."""
        try:
            first = await self._call("warnings", record_once, self.r, self.keys, warning)
        except redis.RedisError as exc:
            first = True
            self.log.warning("warning_not_recorded", error=str(exc))
        if first:
            self.log.warning(event, message=warning.message, **fields)

    def _trajectory(self, task: schemas.Task, status: str, **fields: Any) -> schemas.Trajectory:
        return schemas.Trajectory(
            run=task.run,
            task_id=task.task_id,
            group_id=task.group_id,
            sample_id=task.sample_id,
            index=task.index,
            group_size=task.group_size,
            attempt=task.attempt,
            mode=task.mode,
            runner_id=self.id,
            status=status,  # type: ignore[arg-type]
            min_version=task.min_version,
            resources=dict(task.resources),
            **fields,
        )

    async def _publish(self, delivery: bus.Delivery, trajectory: schemas.Trajectory, taken: float) -> None:
        if trajectory.status == "ok" and trajectory.reward is None:
            trajectory.status, trajectory.error = "failed", "no reward"
        try:
            trajectory.validate()
        except SchemaError as exc:
            trajectory = self._trajectory(delivery.message, "failed", error=f"invalid trajectory: {exc}")
        keys = [self.keys.tasks, self.keys.trajectories, self.keys.attempts, self.keys.ledger]
        target = FINISH_BY_STATUS[trajectory.status].target_state()
        args = [GROUP_RUNNERS, self.id, delivery.entry_id, schemas.encode(trajectory), trajectory.key, target]
        # Safe to repeat through an outage: the script is atomic, so a call either went through
        # whole (the entry is acked, and a repeat finds it no longer ours and returns 0) or not
        # at all. Past the outage deadline the runner exits; the entry stays pending, its lease
        # lapses and another runner redoes the attempt.
        published = await self._call("finish", self._finish, keys=keys, args=args)
        if not published:
            self.counts["lost"] += 1
            self.log.warning(
                "result_dropped_lease_lost", task_id=trajectory.task_id, attempt=trajectory.attempt
            )
            return
        self.counts[trajectory.status] = self.counts.get(trajectory.status, 0) + 1
        self._observe(trajectory, taken)
        await self._watch(trajectory)
        level = self.log.info if trajectory.status == "ok" else self.log.warning
        level(
            "attempt_finished",
            task_id=trajectory.task_id,
            attempt=trajectory.attempt,
            status=trajectory.status,
            reward=trajectory.reward,
            turns=len(trajectory.turns),
            error=trajectory.error,
            seconds=round(time.time() - taken, 4),
        )


class _Pinger:
    """What `RedisOutage.wait_async` pings: the runner's client is synchronous, so in a thread."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    async def ping(self) -> bool:
        return bool(await asyncio.to_thread(self.r.ping))

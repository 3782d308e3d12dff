"""The APO service: rewrites one resource (a system prompt) by textual gradients and a beam.

The loop (docs/optimizer.md; the method is ProTeGi, see apo.py):
1. score the current prompt: one `val` attempt per row of the first `eval_samples` training
   rows, each pinned to the prompt's resource version (Task.resources), and measure it on the
   held-out rows;
2. expand: for each prompt in the beam, the editor critiques it on its lowest-reward attempts
   and writes `candidates` rewrites; each rewrite is published as a *candidate* resource version
   (never handed to training tasks) and scored like step 1;
3. keep the best `beam_width`; when the best beats the current prompt it is promoted (a new
   current version, which new tasks pin) and measured on the held-out rows (a `val` reward
   point named `apo:<resource>@v<version>`);
4. repeat `rounds` times.

Reading the bus: its own group `optimizer` on `trajectories`. Every batch it reads is folded
into its state, and the state (hash `optimizer`, field `state`), the XACKs and the ledger moves
of its evaluation attempts (`validate`, or `give_up` for a failed one) go in ONE MULTI/EXEC: a
kill -9 before EXEC leaves the entries pending (read again at restart), after it they are
counted and acked, so every trajectory counts once. An expansion's dispatch and the state that
remembers it are one transaction too. Trajectories of training tasks that ran the current
prompt add to its pool of low-reward examples.

Evaluation attempts go out like the scheduler's validation groups (the scheduler's
`Dispatcher.queue`: the XADD and the ledger's `dispatch` move in one transaction), one
single-member group `apo<seq>-<i>` per row; the scheduler acks their outcomes as not its own.
A missing one past `eval_timeout_s` counts as reward 0.
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

from squall.scheduler import dataset as ds
from squall.scheduler.dispatch import Dispatcher
from squall.scheduler.groups import Group
from squall.shared import bus, resources, schemas
from squall.shared.config import RunConfig
from squall.shared.heartbeat import HeartbeatWriter
from squall.shared.keys import GROUP_OPTIMIZER, Keys
from squall.shared.ledger import Ledger
from squall.shared.logs import get_logger

from . import apo
from .editor import Editor, EditorUnavailable

HEARTBEAT_EVERY_S = 2.0
READ_COUNT = 256
READ_BLOCK_MS = 1000
EVAL_PREFIX = "apo"
KEEP_LOWEST = 32  # low-reward examples kept per prompt version
SOURCE = "optimizer:apo"  # ResourceVersion.source of what this optimiser publishes


@dataclass
class Evaluation:
    """One prompt version's attempts on a set of rows."""

    version: int
    kind: str  # score (selection rows) | heldout (validation rows)
    expected: int
    started: float
    total: float = 0.0
    done: int = 0

    @property
    def mean(self) -> float:
        return self.total / self.expected if self.expected else 0.0


@dataclass
class State:
    """Everything the optimiser knows; saved as one JSON with its XACKs."""

    phase: str = "start"  # start | scoring | expand | done
    round: int = 0
    current: dict[str, Any] = field(default_factory=dict)  # {version, score, source}: what tasks pin
    beam: list[dict[str, Any]] = field(default_factory=list)  # [{version, score}]
    scored: list[dict[str, Any]] = field(default_factory=list)  # this round's candidates, as scored
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # eval id -> Evaluation fields
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # version -> lowest attempts
    heldout: list[dict[str, Any]] = field(default_factory=list)  # [{round, version, mean}]
    eval_seq: int = 0
    consumed: int = 0
    editor_failures: int = 0  # expansions that got no usable answer before the deadline
    promotions: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> State:
        return cls(**json.loads(raw))


class Optimizer:
    def __init__(self, config: RunConfig, r: redis.Redis, *, editor_url: str) -> None:
        self.config, self.r = config, r
        self.section = config.optimizer
        self.name = self.section.resource
        self.keys = Keys(config.run.name)
        self.log = get_logger(component="optimizer")
        self.ledger = Ledger(r, self.keys)
        self.dispatcher = Dispatcher(r, self.keys, self.ledger, config.scheduler, log=self.log)
        sched = config.scheduler
        self.splits = ds.split(
            ds.load_rows(sched.dataset) if sched.dataset else [],
            ds.load_rows(sched.val_dataset) if sched.val_dataset else None,
            sched.val_fraction,
            config.run.seed,
        )
        self.rows = {s.sample_id: s.row for s in [*self.splits.train, *self.splits.val]}
        self.editor = Editor(
            base_url=editor_url,
            model=self.section.editor_model or config.model.name,
            r=r,
            keys=self.keys,
            api_key=self.section.editor_api_key,
            timeout_s=self.section.editor_timeout_s,
            deadline_s=self.section.editor_deadline_s,
            temperature=self.section.editor_temperature,
            max_tokens=self.section.editor_max_tokens,
            log=self.log,
        )
        self.consumer = bus.GroupConsumer(
            r,
            self.keys.trajectories,
            GROUP_OPTIMIZER,
            "optimizer",  # one optimiser per run: a stable name, so a restart re-reads its pending entries
            kind=schemas.Trajectory,
            deadletter_stream=self.keys.deadletter,
        )
        raw = r.hget(self.keys.optimizer_state, "state")
        self.state = State.from_json(raw) if raw else State()
        self.stopping = False
        instance = f"{socket.gethostname()}-{os.getpid()}"
        self.heartbeat = HeartbeatWriter(r, self.keys, "optimizer", instance, every_s=HEARTBEAT_EVERY_S)

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        published = resources.publish_initial(
            self.r, self.keys, self.config.resources.named(), source="config"
        )
        if self.name not in resources.current_pins(self.r, self.keys):
            raise resources.ResourceError(
                f"optimizer.resource {self.name!r} has no version: add it to the run file's [resources] "
                f'(e.g. {self.name} = "…") or publish it first'
            )
        self.log.info("optimizer_started", resource=self.name, phase=self.state.phase, published=published)
        self._fold(self.consumer.read(READ_COUNT, own_pending=True))  # read before a crash, not acked
        while not self.stopping:
            if self.state.phase == "done" and not self.state.evals:
                self._report("optimizer_finished")
                self.heartbeat.stop(**self._stats())
                return 0
            self.step()
            self._fold(self.consumer.read(READ_COUNT, READ_BLOCK_MS))
            self.heartbeat.beat(**self._stats())
        self._report("optimizer_stopped")
        self.heartbeat.stop(**self._stats())
        return 0

    def _stats(self) -> dict[str, float]:
        """The heartbeat's numbers (`squall status` shows them)."""
        st = self.state
        return {
            "round": st.round,
            "current_version": st.current.get("version", 0),
            "consumed": st.consumed,
            "promotions": st.promotions,
            "editor_failures": st.editor_failures,
            "open_evaluations": len(st.evals),
        }

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def step(self) -> None:
        """Advance the phase when what it waits for has arrived."""
        st = self.state
        self._expire_evals()
        self._close_heldout()
        if st.phase == "start":
            version = resources.current_pins(self.r, self.keys)[self.name][0]
            st.current = {"version": version, "score": None}
            self._dispatch_and_save(
                [(version, "score", self._score_rows()), (version, "heldout", self._heldout_rows())],
                phase="scoring",
            )
        elif st.phase == "scoring":
            if all(e["done"] >= e["expected"] for e in st.evals.values() if e["kind"] == "score"):
                self._select()
        elif st.phase == "expand":
            self._expand()

    # --- reading trajectories ---------------------------------------------------------------
    def _fold(self, deliveries: list[bus.Delivery]) -> None:
        """Count a batch of trajectories into the state; save it with the XACKs, one transaction."""
        if not deliveries:
            return
        validated, given_up = [], []
        for delivery in deliveries:
            traj: schemas.Trajectory = delivery.message
            self.state.consumed += 1
            reward = traj.reward if traj.status == "ok" and traj.reward is not None else 0.0
            version = traj.resources.get(self.name)
            if traj.group_id.startswith(EVAL_PREFIX):
                eval_id = traj.group_id.split("-", 1)[0]
                found = self.state.evals.get(eval_id)
                (validated if traj.status == "ok" else given_up).append(traj.key)
                if found is None:
                    continue  # an evaluation already closed by its deadline
                found["total"] += reward
                found["done"] += 1
                if found["kind"] != "score":
                    continue  # held-out rows are never shown to the editor
            elif traj.mode != "train" or version != self.state.current.get("version"):
                continue
            self._remember(version, traj, reward)
        pipe = self.r.pipeline(transaction=True)
        self.ledger.apply("validate", validated, pipe=pipe)
        self.ledger.apply("give_up", given_up, pipe=pipe)
        pipe.hset(self.keys.optimizer_state, "state", self.state.to_json())
        pipe.xack(self.keys.trajectories, GROUP_OPTIMIZER, *[d.entry_id for d in deliveries])
        pipe.execute()
        self._close_heldout()

    def _remember(self, version: int | None, traj: schemas.Trajectory, reward: float) -> None:
        """Keep the lowest-reward attempts of each prompt version: the editor's examples."""
        if version is None or traj.sample_id not in self.rows:
            return
        kept = self.state.examples.setdefault(str(version), [])
        kept.append(
            {"sample_id": traj.sample_id, "answer": traj.final_answer or traj.error or "", "reward": reward}
        )
        kept.sort(key=lambda e: e["reward"])
        del kept[KEEP_LOWEST:]

    # --- evaluation -----------------------------------------------------------------------
    def _score_rows(self) -> list[ds.Sample]:
        return self.splits.train[: self.section.eval_samples]

    def _heldout_rows(self) -> list[ds.Sample]:
        return self.splits.val[: self.section.heldout_samples or None]

    def _dispatch_and_save(self, plan: list[tuple[int, str, list[ds.Sample]]], *, phase: str) -> None:
        """Dispatch an evaluation per (version, kind, rows) and save the state that expects them:
        one MULTI/EXEC, so a crash leaves both or neither."""
        st = self.state
        weight_version = int(self.r.hget(self.keys.versions, "trainer") or 0)
        pipe = self.r.pipeline(transaction=True)
        for version, kind, rows in plan:
            if not rows:
                continue
            st.eval_seq += 1
            eval_id = f"{EVAL_PREFIX}{st.eval_seq:05d}"
            for i, sample in enumerate(rows):
                group = Group(
                    group_id=f"{eval_id}-{i}",
                    sample_id=sample.sample_id,
                    mode="val",
                    version=weight_version,
                    size=1,
                    epoch=-1,
                    created=time.time(),
                    payload=sample.row,
                    attempts=[0],
                    done=[False],
                    rewards=[None],
                    resources={self.name: [version, -1]},
                )
                self.dispatcher.queue(pipe, group, [0], weight_version)
            st.evals[eval_id] = Evaluation(version, kind, len(rows), time.time()).__dict__
        st.phase = phase
        pipe.hset(self.keys.optimizer_state, "state", st.to_json())
        pipe.execute()

    def _expire_evals(self) -> None:
        """An evaluation past `eval_timeout_s` closes with what it has (missing attempts score 0)."""
        now = time.time()
        for eval_id, found in list(self.state.evals.items()):
            if found["done"] < found["expected"] and now - found["started"] > self.section.eval_timeout_s:
                self.log.warning(
                    "evaluation_timed_out", eval_id=eval_id, done=found["done"], of=found["expected"]
                )
                found["done"] = found["expected"]

    def _finished(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: e for k, e in self.state.evals.items() if e["kind"] == kind and e["done"] >= e["expected"]}

    def _close_heldout(self) -> None:
        """A finished held-out measurement becomes a `val` reward point."""
        for eval_id, found in self._finished("heldout").items():
            ev = Evaluation(**found)
            point = schemas.RewardPoint(
                run=self.keys.run,
                version=int(self.r.hget(self.keys.versions, "trainer") or 0),
                mode="val",
                mean=ev.mean,
                count=ev.expected,
                group_id=f"apo:{self.name}@v{ev.version}",
            )
            self.state.heldout.append({"round": self.state.round, "version": ev.version, "mean": ev.mean})
            del self.state.evals[eval_id]
            pipe = self.r.pipeline(transaction=True)
            pipe.xadd(
                self.keys.rewards,
                {schemas.ENTRY_FIELD: schemas.encode(point)},
                maxlen=100_000,
                approximate=True,
            )
            pipe.hset(self.keys.optimizer_state, "state", self.state.to_json())
            pipe.execute()
            self.log.info("heldout_reward", version=ev.version, mean=round(ev.mean, 4), rows=ev.expected)

    # --- selection and expansion --------------------------------------------------------------
    def _select(self) -> None:
        """Every score evaluation of the round is in: keep the beam, maybe promote the best."""
        st = self.state
        scores = [apo.Scored(e["version"], Evaluation(**e).mean) for e in self._finished("score").values()]
        for eval_id in self._finished("score"):
            del st.evals[eval_id]
        if st.current.get("score") is None:  # the first scoring is the starting prompt's
            start = next(s for s in scores if s.version == st.current["version"])
            st.current["score"], st.beam = start.score, [start.to_json()]
            scores = [s for s in scores if s is not start]
        st.scored = [s.to_json() for s in scores]
        beam = apo.keep_beam([apo.Scored(**b) for b in st.beam] + scores, self.section.beam_width)
        st.beam = [b.to_json() for b in beam]
        plan: list[tuple[int, str, list[ds.Sample]]] = []
        best, current = beam[0], apo.Scored(st.current["version"], st.current["score"])
        if apo.should_promote(best, current, self.section.min_improvement):
            promoted = self._promoted_before(best.version) or resources.promote(
                self.r, self.keys, self.name, best.version, source=SOURCE
            )
            st.examples[str(promoted.version)] = list(st.examples.get(str(best.version), []))
            st.current = {"version": promoted.version, "score": best.score, "from": best.version}
            st.promotions += 1
            plan.append((promoted.version, "heldout", self._heldout_rows()))
            self.log.info(
                "prompt_promoted", version=promoted.version, candidate=best.version, score=best.score
            )
        self._report("round_scored", scored=st.scored, beam=st.beam, current=st.current)
        if scores:  # the starting prompt's own scoring is no round
            st.round += 1
        self._dispatch_and_save(plan, phase="done" if st.round >= self.section.rounds else "expand")

    def _promoted_before(self, candidate: int) -> schemas.ResourceVersion | None:
        """The promotion of `candidate` published before a crash kept the state from saying so
        (a restart then selects again): found, it is not published a second time."""
        version = resources.current_pins(self.r, self.keys)[self.name][0]
        if version == self.state.current.get("version"):
            return None
        found = resources.get(self.r, self.keys, self.name, version)
        return found if found.source == SOURCE and found.note == f"promoted from v{candidate}" else None

    def _expand(self) -> None:
        """Critique and rewrite each prompt of the beam; score the rewrites. An editor that gives
        no usable answer before its deadline costs the round: the current prompt stays."""
        st = self.state
        plan: list[tuple[int, str, list[ds.Sample]]] = []
        for member in st.beam:
            examples = [
                apo.Example(self.rows[e["sample_id"]], e["answer"], e["reward"])
                for e in st.examples.get(str(member["version"]), [])[: self.section.errors_per_critique]
            ]
            if not examples:
                continue
            text = resources.text_of(resources.get(self.r, self.keys, self.name, member["version"]))
            try:
                critique = self.editor.chat(
                    "critique", apo.critique_messages(text, examples), lambda reply: apo.wrapped(reply, 4)
                )
                rewrites = self.editor.chat(
                    "rewrite",
                    apo.rewrite_messages(text, examples, critique, self.section.candidates),
                    lambda reply: apo.wrapped(reply, self.section.candidates),
                )
            except EditorUnavailable as exc:
                st.editor_failures += 1
                self.log.warning("editor_unavailable_prompt_kept", error=str(exc), round=st.round)
                continue
            for rewrite in rewrites:
                if rewrite == text:
                    continue
                candidate = resources.publish(
                    self.r,
                    self.keys,
                    self.name,
                    rewrite,
                    current=False,
                    source=SOURCE,
                    note=f"round {st.round} from v{member['version']}: " + " | ".join(critique)[:2000],
                )
                plan.append((candidate.version, "score", self._score_rows()))
        if plan:
            self._dispatch_and_save(plan, phase="scoring")
        else:
            st.round += 1
            self._dispatch_and_save([], phase="done" if st.round >= self.section.rounds else "expand")
            self._report("round_without_candidates")

    def _report(self, name: str, **fields: Any) -> None:
        st = self.state
        stats = {
            "round": st.round,
            "phase": st.phase,
            "current": st.current,
            "consumed": st.consumed,
            "promotions": st.promotions,
            "editor_failures": st.editor_failures,
            "editor_calls": self.editor.counts["calls"],
        }
        event = schemas.Event(run=self.keys.run, service="optimizer", name=name, fields={**stats, **fields})
        bus.publish(self.r, self.keys.events, event, maxlen=100_000)
        self.log.info(name, **stats)

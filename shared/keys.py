"""Every Redis key, stream and consumer-group name squall uses.

All keys of one run live under ``squall:{run}:`` so several runs share one Redis.
This module is the only place a name is spelled; README's streams table mirrors it
(tests/test_docs.py fails when a key or a field named here is missing from that table).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

PREFIX = "squall"
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# Consumer groups. `tasks` is read by runners; `trajectories` by two independent groups.
# Nothing else reads through a group: the dashboard and `squall peek` read with XREVRANGE and
# need no acknowledgement, so no group of theirs may hold back trimming.
GROUP_RUNNERS = "runners"
GROUP_TRAINER = "trainer"


def trainer_group(role: str = "policy") -> str:
    """The trajectories consumer group of one trained role's trainer: `trainer` for the single
    policy, `trainer:<role>` for each role of a run with several (each settles and acks on its own)."""
    return GROUP_TRAINER if role == "policy" else f"{GROUP_TRAINER}:{role}"


GROUP_SCHEDULER = "scheduler"
# The prompt optimiser's group on `trajectories` (services/optimizer); trimming waits for it
# only where it exists.
GROUP_OPTIMIZER = "optimizer"

# rq (the tool pool, services/toolpool) keeps its own keys under this prefix, outside any run.
RQ_PREFIX = "rq"

# Streams capped with MAXLEN ~ because losing their oldest entries is harmless.
METRICS_MAXLEN = 100_000
EVENTS_MAXLEN = 100_000
DEADLETTER_MAXLEN = 1_000_000
# One entry per published version (and per node and version applied): an inference node reads
# the newest entry at start and follows from there, so old announcements are never read again.
WEIGHTS_MAXLEN = 10_000
WEIGHTS_APPLIED_MAXLEN = 10_000


@dataclass(frozen=True)
class Keys:
    """Key names of one run. `Keys("demo").tasks == "squall:demo:tasks"`."""

    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME_PATTERN.match(self.run):
            from .errors import ConfigError

            raise ConfigError(f"run name {self.run!r} is invalid: use 1-64 letters, digits, '_', '.', '-'")

    def key_for(self, name: str) -> str:
        return f"{PREFIX}:{self.run}:{name}"

    # --- streams ---------------------------------------------------------
    @property
    def tasks(self) -> str:
        """One entry per task attempt (Task). Group `runners`."""
        return self.key_for("tasks")

    @property
    def trajectories(self) -> str:
        """One entry per finished attempt (Trajectory). Groups `trainer`, `scheduler`."""
        return self.key_for("trajectories")

    @property
    def weights(self) -> str:
        """One entry per published policy version (WeightVersion); read without a group."""
        return self.key_for("weights")

    @property
    def weights_applied(self) -> str:
        """Each inference node's acknowledgement of a version it serves (WeightApplied)."""
        return self.key_for("weights:applied")

    @property
    def deadletter(self) -> str:
        """Entries that could not be processed: source, id, reason, raw bytes."""
        return self.key_for("deadletter")

    @property
    def metrics(self) -> str:
        """Trainer step metrics (Metrics), capped."""
        return self.key_for("metrics")

    @property
    def events(self) -> str:
        """Lifecycle events (Event), capped."""
        return self.key_for("events")

    @property
    def control(self) -> str:
        """Operator commands (Control): pause, resume, drain, limits."""
        return self.key_for("control")

    @property
    def resources(self) -> str:
        """One entry per published resource version (ResourceVersion); read without a group."""
        return self.key_for("resources")

    @property
    def optimizer_calls(self) -> str:
        """Every LLM call the optimiser made (Event `editor_call`), capped."""
        return self.key_for("optimizer:calls")

    # --- hashes and sets -----------------------------------------------------
    @property
    def config(self) -> str:
        """Hash: the run's resolved config (JSON under field `json`) and start time."""
        return self.key_for("config")

    @property
    def ledger(self) -> str:
        """Hash: attempt counts per state (see shared.ledger)."""
        return self.key_for("ledger")

    @property
    def attempts(self) -> str:
        """Hash: `task_id#attempt` -> current state of that attempt (the ledger's detail)."""
        return self.key_for("attempts")

    @property
    def scheduler_state(self) -> str:
        """Hash: the scheduler's cursor (epoch, position, next group) so restarts resume."""
        return self.key_for("scheduler")

    @property
    def groups(self) -> str:
        """Hash: group_id -> JSON of the group's open members (owned by the scheduler)."""
        return self.key_for("groups")

    @property
    def heartbeats(self) -> str:
        """Hash: `service:id` -> JSON {time, version, ...}; stale entries mean a dead process."""
        return self.key_for("heartbeats")

    @property
    def versions(self) -> str:
        """Hash: `trainer`, `inference:<node>` and `snapshot:<node>` (a pinned node) -> weight version they hold."""
        return self.key_for("versions")

    @property
    def durable(self) -> str:
        """Hash: `trainer_commit` -> the trainer's last commit whose ledger moves and acks Redis
        holds; less than its checkpoint's commit minus one means Redis lost writes (shared.durability)."""
        return self.key_for("durable")

    @property
    def infra(self) -> str:
        """Hash: `retried:<reason>` and `given_up:<reason>` -> attempts that failed because no
        policy node answered (Trajectory.infra), retried for free or counted as the agent's."""
        return self.key_for("infra")

    @property
    def data_end(self) -> str:
        """Hash: the end-of-data handshake (shared.dataend): the scheduler's `scheduler_at`
        (no training group is coming), the trainer's `trainer_version` (all trained, published)."""
        return self.key_for("data_end")

    @property
    def warnings(self) -> str:
        """Hash: `<kind>:<subject>` -> a RunWarning as JSON (shared.runwarnings), once per run."""
        return self.key_for("warnings")

    @property
    def rewards(self) -> str:
        """Stream of (version, mode, mean reward) points for the reward curve, capped."""
        return self.key_for("rewards")

    @property
    def resources_current(self) -> str:
        """Hash: resource name -> JSON {version, generation} new tasks pin; `<name>:seq` -> last version."""
        return self.key_for("resources:current")

    @property
    def resources_versions(self) -> str:
        """Hash: `name@version` -> the encoded ResourceVersion (versions never change)."""
        return self.key_for("resources:versions")

    @property
    def optimizer_state(self) -> str:
        """Hash: the optimiser's checkpoint (its beam, round, counts), written with its XACKs."""
        return self.key_for("optimizer")

    # --- the tool pool (rq) ------------------------------------------------------
    def tool_queue(self, tool: str) -> str:
        """rq queue name of one tool of the run's pool (`squall worker`); rq itself keeps the
        queue under `rq:queue:<this name>` and its jobs under `rq:job:<id>` (RQ_PREFIX)."""
        return self.key_for(f"tools:{tool}")

    def stream_names(self) -> dict[str, str]:
        """Short name -> full key of every stream, for `squall peek` and status."""
        return {
            "tasks": self.tasks,
            "trajectories": self.trajectories,
            "weights": self.weights,
            "weights:applied": self.weights_applied,
            "deadletter": self.deadletter,
            "metrics": self.metrics,
            "events": self.events,
            "control": self.control,
            "rewards": self.rewards,
            "resources": self.resources,
            "optimizer:calls": self.optimizer_calls,
        }

    def groups_of(self, stream: str, roles: Sequence[str] = ("policy",)) -> tuple[str, ...]:
        """Consumer groups that must exist on `stream` before anyone trims it (`roles`: the
        run's trained roles, each with its own trainer group)."""
        if stream == self.tasks:
            return (GROUP_RUNNERS,)
        if stream == self.trajectories:
            return (*(trainer_group(role) for role in roles), GROUP_SCHEDULER)
        return ()

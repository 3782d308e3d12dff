"""Several trained roles in one trainer process: one LoRA adapter per role on one shared base.

A run file with `[roles.<name>]` tables (shared.roleplan) trains each role on its own:
- `SharedBase`     loads the base model once and gives it one peft adapter per role;
- `RoleBackend`    the torch backend for one role: the shared model with that role's adapter
                   active, its own AdamW over that adapter alone, its own checkpoint state and
                   published tensors (peft's names, as a single-adapter run publishes them);
- `role_view`      what a finished attempt is to one role: only the turns its seats made train,
                   its own reward (`Trajectory.role_rewards`), its own GRPO group (the
                   scheduler's group cut into `roles.<name>.group_size` pieces);
- `RoleTrainer`    the ordinary Trainer for one role: its own consumer group on `trajectories`
                   (`trainer:<role>`), checkpoints, trained log and weights under
                   `{run.dir}/roles/<role>/`, version counter and `versions` field
                   (`trainer:<role>`), WeightVersion.role, Metrics.role;
- `run_roles`      the loop: one unit of work per role in turn, in one process.
Exactly-once holds per role because every role is its own consumer: an entry is acked in a
role's group only once that role's checkpoint covering it is durable, so a kill -9 between two
roles' steps leaves the other role's entries pending in its own group, re-read and trained (or
skipped as done) on restart. The ledger moves of an attempt are applied by every role that
settles it; the moves are idempotent, so the first role to settle an attempt decides its
ledger state (trained, or filtered with that role's reason) and the count stays balanced.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from prometheus_client import Counter, Gauge

from squall.shared import bus, dataend, schemas
from squall.shared.config import RunConfig, TrainerSection
from squall.shared.errors import ConfigError
from squall.shared.logs import get_logger
from squall.shared.retry import REDIS_ERRORS
from squall.shared.roleplan import Role, roles_of, trainer_section
from squall.shared.transformers_compat import enable_activation_checkpointing

from . import distributed, lora
from .sequences import Sample
from .torch_backend import TorchBackend, shares_prefix
from .trainer import Trainer, _on_signal, record_stop_signals

ROLES_DIR = "roles"  # {run.dir}/roles/<role>/: one role's checkpoints, weights and logs
# Per-role Prometheus series (the standard `squall_trainer_step` gauge has no role label; the
# weight version has: `squall_weight_version{role="trainer:<role>"}`).
ROLE_STEP = Gauge("squall_role_step", "Optimizer steps a trained role has taken", ["role"])
ROLE_REWARD = Gauge("squall_role_reward_mean", "Mean reward of a role's last step's groups", ["role"])
ROLE_FILTERED = Counter(
    "squall_role_filtered",
    "Trajectories a role's trainer consumed without training, by reason",
    ["role", "reason"],
)
ROLE_STALENESS = Counter(
    "squall_role_staleness",
    "Trained trajectories of a role by versions behind it",
    ["role", "versions_behind"],
)


def role_dir(config: RunConfig, role: str) -> Path:
    return Path(config.run.dir) / ROLES_DIR / role


def role_config(config: RunConfig, role: str) -> RunConfig:
    """The run config one role's Trainer sees: the role's trainer settings and its own folder."""
    run = config.run.model_copy(update={"dir": str(role_dir(config, role))})
    return config.model_copy(update={"run": run, "trainer": trainer_section(config, role)})


class SharedBase:
    """The base model, loaded once, with one LoRA adapter per role (peft multi-adapter)."""

    def __init__(self, config: RunConfig, roles: Sequence[str]) -> None:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        if not config.model.path:
            raise ValueError("model.path is empty: set it to the base model's transformers folder")
        self.world = distributed.current_world()
        self.device = distributed.rank_device(config.trainer.device, self.world)
        torch.manual_seed(config.run.seed)
        base = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(self.device)
        base.train()
        base.config.use_cache = False
        if config.trainer.gradient_checkpointing:  # before the adapters: peft keeps the setting
            enable_activation_checkpointing(base)
        self.vocab_size = int(base.config.vocab_size)
        pad = getattr(base.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        for role in roles:  # every role's targets, on the plain base, before any adapter goes in
            try:
                lora.check_targets(base, list(trainer_section(config, role).lora_target_modules))
            except ConfigError as exc:
                field = f"roles.{role}.lora.targets" if role in config.roles else lora.TARGETS_FIELD
                raise ConfigError(str(exc).replace(lora.TARGETS_FIELD, field)) from None
        self.model: Any = None
        for role in roles:
            cfg = trainer_section(config, role)
            adapter = lora.lora_config(cfg)
            if self.model is None:
                self.model = get_peft_model(base, adapter, adapter_name=role)
            else:
                self.model.add_adapter(role, adapter)
            self.model.peft_config[role].base_model_name_or_path = config.model.path
        self.active = ""

    def activate(self, role: str) -> None:
        """Make `role`'s adapter the one forwards use and gradients reach (peft's set_adapter
        also marks only its tensors trainable)."""
        if role != self.active:
            self.model.set_adapter(role)
            self.active = role


class RoleBackend(TorchBackend):
    """TorchBackend for one role of a SharedBase: the same step, loss and metrics, on the
    shared model with this role's adapter active and an optimizer over that adapter only."""

    def __init__(
        self, shared: SharedBase, role: str, cfg: TrainerSection
    ) -> None:  # no super(): the model is shared
        self.shared, self.role, self.cfg = shared, role, cfg
        self.world, self.device = shared.world, shared.device
        self.model = shared.model
        self.autocast = self.device.type == "cuda"
        self.share_prefix = shares_prefix(cfg, shared.world)
        self.vocab_size, self.pad_id = shared.vocab_size, shared.pad_id
        self.reference: Any = lora.AdapterDisabled(self.model) if cfg.kl_coef > 0 else None
        marker = f".{role}."  # peft's tensor names carry the adapter's name: lora_A.<role>.weight
        mine = [p for name, p in self.model.named_parameters() if "lora_" in name and marker in name]
        self.optimizer = torch.optim.AdamW(mine, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        self.shared.activate(self.role)
        return super().train_step(samples)

    def loss_on(self, samples: Sequence[Sample]) -> float:
        self.shared.activate(self.role)
        return super().loss_on(samples)

    def weights(self) -> dict[str, Any]:
        return lora.adapter_weights(self.model, adapter=self.role)

    def adapter_config(self) -> dict[str, Any] | None:
        return lora.adapter_config(self.model, adapter=self.role)

    def save_state(self, path: Path) -> None:
        self.shared.activate(self.role)  # trainable_state: the active adapter's tensors
        super().save_state(path)

    def load_state(self, path: Path) -> None:
        self.shared.activate(self.role)
        super().load_state(path)


def role_view(trajectory: schemas.Trajectory, role: Role) -> schemas.Trajectory:
    """`trajectory` as `role` trains it: only turns of its seats train, its reward is the
    role's, and its group is the role's piece of the scheduler's group. The task id, and so the
    key and the ledger entry, stay the attempt's."""
    turns = [
        turn if not turn.trained or _serves(turn, role) else msgspec.structs.replace(turn, trained=False)
        for turn in trajectory.turns
    ]
    reward = (
        trajectory.role_rewards.get(role.name, trajectory.reward) if trajectory.reward is not None else None
    )
    changes: dict[str, Any] = {"turns": turns, "reward": reward}
    if role.group_size < trajectory.group_size:
        piece = trajectory.index // role.group_size
        changes.update(
            group_id=f"{trajectory.group_id}/{piece}",
            index=trajectory.index % role.group_size,
            group_size=role.group_size,
        )
    return msgspec.structs.replace(trajectory, **changes)


def _serves(turn: schemas.Turn, role: Role) -> bool:
    """The turn was made for `role`: the gateway recorded the role, and the agent is its seat."""
    return turn.role == role.name and role.covers(turn.agent)


class RoleTrainer(Trainer):
    """The Trainer of one role; everything it reads passes through `role_view` first."""

    def __init__(self, config: RunConfig, role: Role, backend: RoleBackend) -> None:
        self.plan = role
        super().__init__(role_config(config, role.name), backend, role=role.name)
        self.run_config = config  # the whole run's (role_config changed run.dir and trainer)

    def _emit_metrics(self, values: dict[str, float]) -> None:
        super()._emit_metrics(values)
        ROLE_STEP.labels(role=self.role).set(self.state.step)
        ROLE_REWARD.labels(role=self.role).set(values.get("reward_mean", 0.0))
        for name, value in values.items():
            if name.startswith("filtered:") or name == "late":
                ROLE_FILTERED.labels(role=self.role, reason=name.removeprefix("filtered:")).inc(value)
            elif name.startswith("staleness/"):
                ROLE_STALENESS.labels(role=self.role, versions_behind=name.split("/", 1)[1]).inc(value)

    def _handle(self, deliveries: list[bus.Delivery]) -> None:
        super()._handle(
            [bus.Delivery(d.entry_id, role_view(d.message, self.plan), d.deliveries) for d in deliveries]
        )

    def _data_end(self) -> dataend.DataEnd:
        """The data end as this role sees it: owed until this role answered (`trainer_version:<role>`)."""
        end = dataend.read(self.r, self.keys)
        answers = dataend.role_answers(self.r.hgetall(self.keys.data_end))  # HGETALL: what the ACL grants
        return dataclasses.replace(end, trainer_version=answers.get(self.role))

    def _announce_trained(self) -> None:
        """This role's answer; the run's (what the scheduler waits for) once every role answered.
        The run's end version is the first role's (the scheduler validates one version)."""
        self.r.hset(self.keys.data_end, dataend.role_answer_field(self.role), self.state.version)
        answers = dataend.role_answers(self.r.hgetall(self.keys.data_end))
        names = [role.name for role in roles_of(self.run_config)]
        if all(name in answers for name in names):
            dataend.announce_trained(self.r, self.keys, answers[names[0]], self.state.step)


def build_trainers(config: RunConfig) -> list[RoleTrainer]:
    """One RoleTrainer per role of `config`, sharing one base model."""
    roles = roles_of(config)
    shared = SharedBase(config, [role.name for role in roles])
    return [
        RoleTrainer(config, role, RoleBackend(shared, role.name, trainer_section(config, role.name)))
        for role in roles
    ]


class RoleLoop:
    """Every role's Trainer, given one unit of work in turn, until each reached max_steps or a
    stop; a Redis outage is ridden out as the single trainer does, then every role recovers."""

    def __init__(self, trainers: list[RoleTrainer]) -> None:
        self.trainers = trainers
        self.stopping = False

    def request_stop(self, *_: Any) -> None:
        self.stopping = True
        for trainer in self.trainers:
            trainer.request_stop()

    def run(self, *, max_rounds: int = 0) -> int:
        """`max_rounds` > 0: stop after that many rounds (tests)."""
        recovering, first, rounds = True, True, 0
        try:
            while True:
                try:
                    if recovering:
                        for trainer in self.trainers:
                            trainer._recover(announce=first)
                        recovering = first = False
                    busy = [t for t in self.trainers if not t._reached_max_steps()]
                    if self.stopping or not busy or (max_rounds and rounds >= max_rounds):
                        for trainer in self.trainers:
                            trainer._flush()
                        break
                    for trainer in busy:
                        trainer._work_once()
                    rounds += 1
                except REDIS_ERRORS as exc:
                    self.trainers[0].outage.wait(self.trainers[0].r, exc, where="trainer loop (roles)")
                    recovering = True
        finally:
            for trainer in self.trainers:
                trainer._stopped()
        return 0


def run_roles(config: RunConfig) -> int:
    """The trainer of a run with [roles]: one process, /health, every role trained in turn."""
    from squall.monitor.health import start_health_server

    log = get_logger(service="trainer", run=config.run.name)
    early_stop = record_stop_signals()
    built: list[RoleLoop] = []
    health, port = start_health_server(
        config.trainer.metrics_host,
        config.trainer.metrics_port,
        ready=lambda: bool(built) and not built[0].stopping,
        info=lambda: (
            {t.role: {"step": t.state.step, "version": t.state.version} for t in built[0].trainers}
            if built
            else {"loading": True}
        ),
    )
    try:
        loop = RoleLoop(build_trainers(config))
        for trainer in loop.trainers:
            trainer.metrics_port = port
        if early_stop:
            loop.request_stop()
        built.append(loop)
        _on_signal(signal.SIGTERM, loop.request_stop)
        _on_signal(signal.SIGINT, loop.request_stop)
        log.info("roles_trainer_started", roles=[t.role for t in loop.trainers])
        return loop.run()
    finally:
        health.close()

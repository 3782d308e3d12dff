"""Which role each agent's calls train, and each role's own settings: the run's role plan.

A run file's `[roles.<name>]` tables (config.RoleSection) become one `Role` each. A run file
without them has exactly one role, `policy` (shared.roles.DEFAULT_ROLE), covering the agents
`runner.train_agents` lists (every agent when that list is empty) with the trainer's own LoRA
and optimizer settings: the single-policy run of before, unchanged.

`check_roles` refuses a plan that cannot run, naming the field: a seat claimed by two roles, a
role with no seats, a name that cannot name a role, a group size that does not divide the
scheduler's, roles together with `runner.train_agents`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .roles import DEFAULT_ROLE, ROLE_NAME

if TYPE_CHECKING:
    from .config import RunConfig, TrainerSection


@dataclass(frozen=True)
class Role:
    name: str
    agents: tuple[str, ...]  # empty: every agent (the single-policy run with no train_agents)
    group_size: int  # the role's GRPO group size (divides scheduler.group_size)
    declared: bool  # False: the implicit `policy` role of a run file without [roles]

    def covers(self, agent: str) -> bool:
        return not self.agents or agent in self.agents


def check_roles(config: RunConfig) -> None:
    """ValueError naming the field when `config.roles` cannot run (see the module doc)."""
    if not config.roles:
        return
    owner: dict[str, str] = {}
    for name, role in config.roles.items():
        if not ROLE_NAME.match(name):
            raise ValueError(
                f"roles.{name}: {name!r} cannot name a role: use a letter, then letters, digits, '_' or '-' "
                "(at most 64 characters)"
            )
        if not role.agents:
            raise ValueError(f"roles.{name}.agents is empty: list the agent names (seats) this role trains")
        for agent in role.agents:
            if agent in owner and owner[agent] != name:
                raise ValueError(
                    f"roles.{name}.agents: seat {agent!r} is claimed by roles.{owner[agent]} too; "
                    "a seat trains one role: keep it in one of them"
                )
            owner[agent] = name
        if config.runner.seats:
            unknown = [a for a in role.agents if a not in config.runner.seats]
            if unknown:
                raise ValueError(
                    f"roles.{name}.agents names {unknown}, which are not in runner.seats "
                    f"{config.runner.seats}: fix the name or add the seat"
                )
        size = role.group_size or config.scheduler.group_size
        if config.scheduler.group_size % size:
            raise ValueError(
                f"roles.{name}.group_size = {size} does not divide scheduler.group_size = "
                f"{config.scheduler.group_size}: a role's groups split the scheduler's"
            )
    if config.runner.train_agents:
        raise ValueError(
            "runner.train_agents and [roles] both say which agents train: with roles, list the seats "
            "in roles.<name>.agents and leave runner.train_agents empty"
        )
    if config.trainer.backend != "torch":
        raise ValueError(
            f"[roles] need trainer.backend = 'torch' (one LoRA adapter per role), not {config.trainer.backend!r}"
        )


def roles_of(config: RunConfig) -> list[Role]:
    """The run's roles in the run file's order (the implicit `policy` role without [roles])."""
    size = config.scheduler.group_size
    if not config.roles:
        return [Role(DEFAULT_ROLE, tuple(config.runner.train_agents), size, declared=False)]
    return [
        Role(name, tuple(section.agents), section.group_size or size, declared=True)
        for name, section in config.roles.items()
    ]


def role_of_agent(config: RunConfig, agent: str) -> str | None:
    """The role whose adapter serves and trains `agent`'s calls; None: nobody trains them."""
    return next((role.name for role in roles_of(config) if role.covers(agent)), None)


def trainer_section(config: RunConfig, role: str) -> TrainerSection:
    """The trainer settings one role trains with: the trainer's, with the role's adapter,
    learning rate and estimator put in (the implicit `policy` role: the trainer's as they are)."""
    section = config.roles.get(role) if config.roles else None
    if section is None:
        return config.trainer
    changes: dict[str, object] = {
        "lora_rank": section.lora.rank,
        "lora_alpha": section.lora.alpha,
        "lora_dropout": section.lora.dropout,
        "consumer": f"{config.trainer.consumer}:{role}",
    }
    if section.lora.targets:
        changes["lora_target_modules"] = list(section.lora.targets)
    if section.lr is not None:
        changes["lr"] = section.lr
    if section.estimator is not None:
        changes["advantage"] = section.estimator
    return config.trainer.model_copy(update=changes)

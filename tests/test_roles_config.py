"""The run file's [roles] tables (shared.roleplan) and per-role rewards (runner/rolerewards.py):
a plan that cannot run is refused with the field named; no [roles] is the single `policy` role
exactly as before; a reward table must give every role one finite number."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from squall.runner.rolerewards import split_role_rewards
from squall.shared.config import load_config
from squall.shared.errors import AgentError, ConfigError
from squall.shared.keys import Keys
from squall.shared.roleplan import role_of_agent, roles_of, trainer_section
from squall.trainer.multirole import role_config


def config(roles=None, **sections):
    base = {name: dict(fields) for name, fields in sections.items()}
    if roles is not None:
        base["roles"] = roles
    return load_config(base=base, env={})


@pytest.mark.parametrize(
    ("roles", "sections", "named"),
    [
        (
            {"wolves": {"agents": ["w1"]}, "villagers": {"agents": ["v1", "w1"]}},
            {},
            "roles.villagers.agents: seat 'w1'",
        ),
        ({"wolves": {"agents": []}}, {}, "roles.wolves.agents is empty"),
        ({"wolves": {}}, {}, "roles.wolves.agents is empty"),
        ({"bad@name": {"agents": ["a"]}}, {}, "roles.bad@name: 'bad@name' cannot name a role"),
        ({"1st": {"agents": ["a"]}}, {}, "roles.1st:"),
        (
            {"w": {"agents": ["a"], "group_size": 3}},
            {"scheduler": {"group_size": 8}},
            "roles.w.group_size = 3",
        ),
        ({"w": {"agents": ["ghost"]}}, {"runner": {"seats": ["a", "b"]}}, "roles.w.agents names ['ghost']"),
        ({"w": {"agents": ["a"]}}, {"runner": {"train_agents": ["a"]}}, "runner.train_agents and [roles]"),
        ({"w": {"agents": ["a"], "lora": {"rank": 0}}}, {}, "roles.w.lora.rank"),
        ({"w": {"agents": ["a"], "estimator": "ppo"}}, {}, "roles.w.estimator"),
        ({"w": {"agents": ["a"], "lr": -1}}, {}, "roles.w.lr"),
        ({"w": {"agents": ["a"], "seats": ["a"]}}, {}, "roles.w.seats"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_naming_the_field(roles, sections, named):
    with pytest.raises(ConfigError) as caught:
        config(roles, **sections)
    assert named in str(caught.value), str(caught.value)


def test_no_roles_is_the_single_policy_run():
    plain = config(runner={"train_agents": ["main"]}, trainer={"lr": 2e-5, "lora_rank": 4})
    (role,) = roles_of(plain)
    assert (role.name, role.agents, role.declared, role.group_size) == ("policy", ("main",), False, 4)
    assert trainer_section(plain, "policy") is plain.trainer  # the trainer's settings, untouched
    assert role_of_agent(plain, "main") == "policy" and role_of_agent(plain, "judge") is None
    assert config().roles == {} and roles_of(config())[0].covers("anyone")
    assert Keys("r").groups_of(Keys("r").trajectories) == ("trainer", "scheduler")


def test_each_role_gets_its_own_settings_folder_and_group():
    run = config(
        {
            "wolves": {"agents": ["w1", "w2"], "lr": 1e-3, "estimator": "rloo", "group_size": 4,
                       "lora": {"rank": 8, "alpha": 16, "targets": ["q_proj"]}},
            "villagers": {"agents": ["v1"]},
        },
        scheduler={"group_size": 8},
        trainer={"lr": 1e-5, "lora_alpha": 32},
        run={"dir": "runs/x"},
    )  # fmt: skip
    assert [(r.name, r.agents, r.group_size) for r in roles_of(run)] == [
        ("wolves", ("w1", "w2"), 4), ("villagers", ("v1",), 8)
    ]  # fmt: skip
    wolves, villagers = trainer_section(run, "wolves"), trainer_section(run, "villagers")
    assert (wolves.lr, wolves.advantage, wolves.lora_rank, wolves.lora_alpha, wolves.lora_target_modules) == (
        1e-3, "rloo", 8, 16.0, ["q_proj"]
    )  # fmt: skip
    assert (villagers.lr, villagers.advantage, villagers.lora_rank) == (1e-5, "grpo", 8)  # role defaults
    assert villagers.lora_target_modules == run.trainer.lora_target_modules
    assert role_config(run, "wolves").run.dir == "runs/x/roles/wolves"
    assert role_of_agent(run, "w2") == "wolves" and role_of_agent(run, "v1") == "villagers"
    assert role_of_agent(run, "judge") is None
    keys = Keys("r")
    assert keys.groups_of(keys.trajectories, ["wolves", "villagers"]) == (
        "trainer:wolves",
        "trainer:villagers",
        "scheduler",
    )


def test_a_reward_table_gives_every_role_one_finite_number():
    assert split_role_rewards(0.5, ["a", "b"]) == (0.5, {})  # one number: every role alike
    assert split_role_rewards({"a": 1, "b": 0.0}, ["a", "b"]) == (0.5, {"a": 1.0, "b": 0.0})
    for table, said in [
        ({"a": 1.0}, "no reward for role(s) ['b']"),
        ({"a": 1.0, "b": 0.0, "c": 1.0}, "names ['c'], which are not roles"),
        ({"a": math.nan, "b": 0.0}, "role 'a' is nan"),
        ({"a": True, "b": 0.0}, "role 'a' is True"),
        ({"a": "1", "b": 0.0}, "role 'a' is '1'"),
    ]:
        with pytest.raises(AgentError, match="agent's reward") as caught:
            split_role_rewards(table, ["a", "b"])
        assert said in str(caught.value)
    with pytest.raises(AgentError, match="declares no \\[roles\\]"):
        split_role_rewards({"a": 1.0}, [])


def test_dispatch_lag_holds_for_each_role_on_its_own():
    from squall.scheduler.admission import admits
    from squall.scheduler.groups import Group

    def rolling(**versions):
        return Group(group_id="g", sample_id="s", mode="train", version=min(versions.values()), size=2, epoch=0,
                     created=0.0, payload={}, role_versions=versions)  # fmt: skip

    groups = [rolling(wolves=3, villagers=0)]
    # The villagers moved 2 versions past the oldest rolling group's, the wolves none: lag 1 refuses.
    assert not admits(groups, 0, 8, 1, {"wolves": 3, "villagers": 2})
    assert admits(groups, 0, 8, 2, {"wolves": 3, "villagers": 2})
    assert admits(groups, 0, 8, 1, {"wolves": 4, "villagers": 1})  # each one version ahead
    assert not admits(groups, 0, 8, 0, {"wolves": 4, "villagers": 0})  # the wolves moved
    assert admits([], 0, 8, 0, {"wolves": 9, "villagers": 9})  # nothing rolling out
    # The single policy: the group's one version, as before.
    plain = Group(
        group_id="g", sample_id="s", mode="train", version=1, size=2, epoch=0, created=0.0, payload={}
    )
    assert admits([plain], 2, 8, 1) and not admits([plain], 3, 8, 1)


def test_werewolf_roles_agent_names_seats_by_team_and_reads_its_league(monkeypatch):
    from examples.werewolf import roles_agent

    game = {"id": "train-1", "seed": 3, "wolves": [2, 5], "clues": {"1": 2, "3": 5, "4": 2, "6": 5}}
    assert roles_agent.seat_names(game) == {
        1: "villager_1", 2: "wolf_1", 3: "villager_2", 4: "villager_3", 5: "wolf_2", 6: "villager_4"
    }  # fmt: skip
    run = load_config(
        path=Path(__file__).resolve().parents[1] / "examples" / "werewolf" / "roles.toml", env={}
    )
    assert {role.name: set(role.agents) for role in roles_of(run)} == {
        "villagers": {"villager_1", "villager_2", "villager_3", "villager_4"}, "wolves": {"wolf_1", "wolf_2"}
    }  # fmt: skip
    monkeypatch.delenv("WEREWOLF_LEAGUE_FRACTION", raising=False)
    monkeypatch.delenv("WEREWOLF_LEAGUE", raising=False)
    assert roles_agent.league() == (0.0, [0])
    monkeypatch.setenv("WEREWOLF_LEAGUE_FRACTION", "0.3")
    monkeypatch.setenv("WEREWOLF_LEAGUE", "0, 4,8")
    assert roles_agent.league() == (0.3, [0, 4, 8])
    monkeypatch.setenv("WEREWOLF_LEAGUE_FRACTION", "2")
    with pytest.raises(ValueError, match="WEREWOLF_LEAGUE_FRACTION"):
        roles_agent.league()

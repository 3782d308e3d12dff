"""Turn-level rewards end to end on the runner side: a real runner, its gateway and a real
inference server (tiny model). llm.emit_reward and the command agents' POST .../v1/reward
attach each reward to the call it follows, the trajectory records them, and bad rewards fail
only their own attempt (or answer 400) while the runner goes on."""

from __future__ import annotations

import sys

import pytest
from runner_helpers import TESTS_DIR, dispatch, trajectories
from test_gateway_agents import inference, model_dir, procs  # noqa: F401  (fixtures)
from waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_function_agent_turn_rewards_and_bad_ones(r, run_name, procs, inference):  # noqa: F811
    rows = [{"behave": b} for b in ("steps", "nan", "early", "steps")]
    dispatch(r, run_name, rows)
    procs.start("runner", "--agent", "turn_reward_agents:agent", "--inference-url", inference)
    got = wait_for(lambda: (t := trajectories(r, run_name)) and len(t) == 4 and t, 90, "4 trajectories")
    by = {t.sample_id: t for t in got}
    for sample in ("0", "3"):  # the runner kept going after the two bad attempts
        steps = by[sample]
        assert steps.status == "ok", steps.error
        assert [t.reward for t in steps.turns] == [0.75, 0.125]
        assert steps.reward == 0.75 + 0.125 + 2.0  # emitted plus the returned outcome
    nan = by["1"]
    assert nan.status == "failed" and "llm.emit_reward(nan)" in nan.error and "finite" in nan.error
    early = by["2"]
    assert early.status == "failed" and "llm.emit_reward(1.0) before any model call" in early.error
    assert early.turns == []


def test_command_agent_posts_turn_rewards(r, run_name, procs, inference):  # noqa: F811
    dispatch(r, run_name, [{"q": 1}])
    agent = f"{sys.executable} {TESTS_DIR / 'turn_reward_agents.py'}"
    procs.start("runner", "--agent-cmd", agent, "--inference-url", inference)
    (traj,) = wait_for(lambda: trajectories(r, run_name), 90, "the command agent's trajectory")
    assert traj.status == "ok", traj.error
    assert [t.reward for t in traj.turns] == [0.75]
    assert traj.reward == 0.75

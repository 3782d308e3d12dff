"""A run with two trained roles, on the runner side, with a real runner, gateway and inference
node (tiny model): each seat's call goes to the node with model = its role, the recorded turn
names its role and trains only it, a pinned `role@version` is passed through and never trained,
and the agent's reward table becomes the trajectory's per-role rewards."""

from __future__ import annotations

import json
import subprocess

import pytest
from runner_helpers import Procs
from test_gateway_agents import model_dir, run_one, start_inference  # noqa: F401  (model_dir: a fixture)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROLES = {"wolves": {"agents": ["wolf"]}, "villagers": {"agents": ["vil"]}}


def test_each_seat_is_served_and_recorded_as_its_role(r, redis_url, run_name, tmp_path, model_dir):  # noqa: F811
    node, url = start_inference(model_dir, tmp_path, "--served-name", "wolves")  # today's node: one name
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_RUNNER__GRACE_S="1")
    try:
        traj = run_one(
            r, run_name, procs, "role_agents:two_seats", url, {},
            SQUALL_RUNNER__SEATS='["wolf", "vil"]',
            SQUALL_ROLES__WOLVES=json.dumps(ROLES["wolves"]),
            SQUALL_ROLES__VILLAGERS=json.dumps(ROLES["villagers"]),
        )  # fmt: skip
    finally:
        procs.stop_all()
        node.terminate()
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:  # a loaded machine: do not leave it behind
            node.kill()
            node.wait(10)
    assert traj.status == "ok", traj.error
    assert traj.role_rewards == {"wolves": 1.0, "villagers": 1.0}  # every call reached the node as expected
    assert traj.reward == 1.0  # the mean of the table
    wolf = traj.turns[0]
    assert (wolf.agent, wolf.role, wolf.trained, wolf.model) == (
        "wolf",
        "wolves",
        True,
        "whatever-the-agent-says",
    )
    assert len(wolf.response_tokens) > 0
    for turn in traj.turns[1:]:  # served only by a node with the villagers' adapter / the snapshot
        pinned = turn.model == "wolves@0"
        assert (turn.agent, turn.role, turn.trained) == (
            "vil",
            "wolves" if pinned else "villagers",
            not pinned,
        )

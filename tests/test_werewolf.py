"""The Werewolf team game (examples/werewolf): rules, generator, reward, a played game through
the real gateway, and a shortened learning run through `squall up` (slow).

The played game runs the unchanged agent against the committed warm-start policy on one node
and the same policy on a second node serving the frozen name "opponent": every seat's call is
attributed to its seat, the wolves' turns go to the opponent and are never trained.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inference_helpers import NodeThread

from examples.werewolf import agent as ww_agent
from examples.werewolf import game as rules
from squall.runner.agents import LLM
from squall.runner.gateway import Gateway
from squall.shared.config import RunnerSection, load_config
from squall.shared.errors import ConfigError
from squall.shared.localredis import free_port

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "werewolf" / "policy"
SEATS = [f"seat{s}" for s in rules.SEATS]


def _votes(**by_seat: int | None) -> dict[int, int | None]:
    return {int(k.removeprefix("s")): v for k, v in by_seat.items()}


# --- generator ----------------------------------------------------------------------------------


def test_games_are_seeded_valid_and_the_splits_independent():
    train = rules.generate("train", 300, seed=0)
    assert train == rules.generate("train", 300, seed=0)
    assert train != rules.generate("train", 300, seed=1)
    assert rules.generate("val", 50, 0) == rules.generate("val", 50, 0)
    assert rules.generate("train", 10, 0) == train[:10]  # more training games leave the first ones alone
    assert {g["id"] for g in rules.generate("val", 50, 0)}.isdisjoint(g["id"] for g in train)
    for game in train:
        rules.check_game(game)
        assert len(game["clues"]) == len(rules.SEATS) - rules.WOLVES
    # Every seat is a wolf sometimes, and a team's clues name both wolves in some games.
    assert {w for g in train for w in g["wolves"]} == set(rules.SEATS)
    assert any(len(set(g["clues"].values())) == 2 for g in train)


def test_the_generator_cli_writes_jsonl(tmp_path):
    assert rules.main(["--out", str(tmp_path), "--train", "5", "--val", "3", "--seed", "2"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert rows == rules.generate("train", 5, 2)
    assert len((tmp_path / "val.jsonl").read_text().splitlines()) == 3


def test_a_bad_game_row_is_refused_naming_the_field():
    game = rules.generate("train", 1, 0)[0]
    with pytest.raises(ValueError, match="'wolves' must be 2 distinct seats"):
        rules.check_game({**game, "wolves": [1, 1]})
    villager = next(iter(game["clues"]))
    with pytest.raises(ValueError, match="'clues' must map every villager seat"):
        rules.check_game({**game, "clues": {**game["clues"], villager: int(villager)}})
    with pytest.raises(ValueError, match="examples.werewolf.game"):
        rules.check_game({k: v for k, v in game.items() if k != "clues"})


# --- rules and reward ---------------------------------------------------------------------------


def test_prompts_give_each_seat_only_its_own_secret():
    game = {"id": "x", "seed": 1, "wolves": [2, 5], "clues": {"1": 2, "3": 5, "4": 2, "6": 5}}
    assert rules.prompt(game, 3) == "You are seat 3, a villager. Seat 5 is a wolf. Your vote?"
    assert rules.prompt(game, 2) == "You are seat 2, a wolf. Seat 5 is the other wolf. Your vote?"
    for seat in (1, 3, 4, 6):  # a villager never hears about the wolf its clue does not name
        other = next(w for w in game["wolves"] if w != game["clues"][str(seat)])
        assert f"Seat {other} " not in rules.prompt(game, seat)


@pytest.mark.parametrize(
    ("text", "seat", "vote"),
    [("5", 1, 5), (" 3<|im_end|>", 1, 3), ("I vote 4, then 2", 1, 4), ("1", 1, None), ("7", 1, None),
     ("0", 2, None), ("", 2, None), (None, 2, None), ("seat six", 2, None), ("12", 3, None)],
)  # fmt: skip
def test_parse_vote(text, seat, vote):
    assert rules.parse_vote(text, seat) == vote


def test_the_most_voted_seat_is_out_and_ties_follow_the_game_seed():
    game = {"id": "x", "seed": 7, "wolves": [2, 5], "clues": {"1": 2, "3": 5, "4": 2, "6": 5}}
    assert rules.eliminated(game, _votes(s1=2, s2=3, s3=2, s4=2, s5=3, s6=5)) == 2
    assert rules.villagers_win(game, _votes(s1=2, s2=3, s3=2, s4=2, s5=3, s6=5))
    assert not rules.villagers_win(game, _votes(s1=3, s2=3, s3=1, s4=2, s5=3, s6=5))
    assert rules.eliminated(game, dict.fromkeys(rules.SEATS)) is None  # everybody abstained
    assert not rules.villagers_win(game, dict.fromkeys(rules.SEATS))
    tie = _votes(s1=2, s2=3, s3=5, s4=4, s5=3, s6=4)  # 3 and 4 with two votes each
    outs = {rules.eliminated({**game, "seed": seed}, tie) for seed in range(40)}
    assert outs == {3, 4}  # a fair coin over the tied seats only
    assert rules.eliminated(game, tie) == rules.eliminated(game, tie)  # the same game, the same coin


def test_the_clue_is_worth_following():
    """The learnable gap: scripted villagers who follow their clue win far more often."""
    games = rules.generate("simulate", 3000, 0)
    rates = [rules.simulate(games, p, seed=1) for p in (0.0, 0.2, 0.5, 1.0)]
    assert rates == sorted(rates)
    assert rates[0] < 0.3 and rates[-1] > 0.9, rates


# --- a played game through the gateway ------------------------------------------------------------


async def _play(policy_url: str, opponent_url: str, games: list[dict]) -> list:
    section = RunnerSection(
        inference_urls=[policy_url], frozen_models={"opponent": opponent_url}, seats=SEATS
    )
    gateway = Gateway(section, "policy")
    await gateway.start()
    played = []
    try:
        for index, game in enumerate(games):
            attempt = gateway.open(f"g{index}:0#0")
            root = gateway.base_url(attempt.token).removesuffix("/v1")
            llm = LLM(base_url=f"{root}/v1", model="policy", api_key=f"squall-{attempt.token}", _root=root)
            reward = await ww_agent.agent(game, llm)
            gateway.close(attempt.token)
            assert attempt.error is None
            played.append((game, reward, attempt.turns))
    finally:
        await gateway.stop()
    return played


@pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the werewolf policy is not built")
def test_a_game_through_the_gateway_trains_the_villagers_only():
    policy = NodeThread(POLICY).start()
    opponent = NodeThread(POLICY, model_name="opponent").start()
    try:
        played = asyncio.run(_play(policy.url, opponent.url, rules.generate("val", 6, 3)))
    finally:
        opponent.stop()
        policy.stop()
    for game, reward, turns in played:
        assert sorted(t.agent for t in turns) == SEATS  # one call per seat, named by its URL
        for turn in turns:
            seat = int(turn.agent.removeprefix("seat"))
            wolf = seat in game["wolves"]
            assert turn.model == ("opponent" if wolf else "policy")
            assert turn.trained is not wolf
            if wolf:  # the frozen endpoint is asked for text only: no token ids to train on
                assert len(turn.response_tokens) == 0
            else:
                assert len(turn.response_tokens) == len(turn.logprobs) > 0 and turn.version == 0
        assert reward in (0.0, 1.0)


# --- a shortened learning run ---------------------------------------------------------------------


@pytest.mark.timeout(480)  # its own subprocess budget, past the suite-wide 300 s
@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the werewolf policy is not built")
def test_a_short_run_learns_to_follow_the_clue(tmp_path):
    data = tmp_path / "data"
    rules.main(["--out", str(data), "--train", "400", "--val", "64", "--seed", "0"])
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "SQUALL_RUN__REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # a private embedded Redis
        "SQUALL_RUN__DIR": str(run_dir),
        "SQUALL_SCHEDULER__DATASET": str(data / "train.jsonl"),
        "SQUALL_SCHEDULER__VAL_DATASET": str(data / "val.jsonl"),
        "SQUALL_SCHEDULER__MAX_SAMPLES": "96",
        "SQUALL_SCHEDULER__VAL_SAMPLES": "64",
        "SQUALL_SCHEDULER__VAL_EVERY": "100",  # once at the start, once at the end
    }
    done = subprocess.run(
        [sys.executable, "-m", "squall.cli", "up", "--config", "examples/werewolf/run.toml",
         "--minutes", "4", "--label", "werewolf"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "scheduler finished the dataset" in out, out[-3000:]
    assert "unclean exits" not in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger_balanced"], summary["ledger"]
    versions = summary["versions"]
    assert versions["inference:node0"] >= 10, versions  # the policy moved on ...
    assert versions["snapshot:opponent"] == 0, versions  # ... and the wolves' snapshot did not
    val = [point["mean"] for point in summary["val_curve"]]
    assert len(val) >= 2, summary["val_curve"]
    print(out.strip().splitlines()[-1])  # werewolf: val_reward_start=... val_reward_end=... minutes=...
    assert val[-1] >= val[0] + 0.2, val  # measured: 0.40 -> 0.99 by version 16 in the full run


def test_run_files_load_and_a_bad_snapshot_is_refused_naming_the_field():
    for name in ("run.toml", "gpu.toml"):
        config = load_config(ROOT / "examples" / "werewolf" / name, env={})
        assert config.inference.snapshots == {"opponent": 0}
        assert config.runner.seats == SEATS
    with pytest.raises(ConfigError, match="inference.snapshots"):
        load_config(env={}, overrides={"inference": {"snapshots": {"opponent": -1}}})

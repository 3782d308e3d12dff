"""Werewolf with both teams learning (examples/werewolf/roles.toml): the villagers and the wolves
are two trained roles of one run, each with its own LoRA adapter on the shared warm start.

    async def agent(task, llm) -> dict[str, float]

Seats are named by team, not by table position, so a run file can say which role trains them:
the wolves speak as `wolf_1`, `wolf_2` and the villagers as `villager_1` .. `villager_4` (in
seat order). The gateway serves every call of a seat with its role's newest adapter and
records it for that role. The reward is a table, one number per role: a won vote is 1 for the
villagers and 0 for the wolves, and the other way round.

Training games (ids not starting with "val-"): both teams play their newest adapters against
each other; with the league on (`WEREWOLF_LEAGUE_FRACTION` > 0), that share of the games sets
one team (drawn per game) against a frozen snapshot of the other, drawn from the versions listed
in `WEREWOLF_LEAGUE` (default "0", the warm start). A snapshot seat asks for `role@version`,
which the gateway serves as that exact version and never trains; the versions listed must be
published already.

Held-out games (ids "val-..."): each team is measured against the fixed warm start. Two votes
are played on the same game: the villagers' adapter against `wolves@0`, and `villagers@0`
against the wolves' adapter. The reward table holds each team's win in its own vote, so the
validation curve of a role is its win rate against the warm start.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from examples.werewolf import game as rules

VILLAGERS, WOLVES = "villagers", "wolves"
WARM_START = 0  # version 0 of every role is the warm start (a fresh adapter adds nothing)
MAX_TOKENS = 8


def seat_names(task: dict) -> dict[int, str]:
    """Table seat -> agent name: wolf_1, wolf_2 and villager_1 .. villager_4, in seat order."""
    names: dict[int, str] = {}
    counts = {"wolf": 0, "villager": 0}
    for seat in rules.SEATS:
        team = rules.role(task, seat)
        counts[team] += 1
        names[seat] = f"{team}_{counts[team]}"
    return names


def league() -> tuple[float, list[int]]:
    fraction = float(os.environ.get("WEREWOLF_LEAGUE_FRACTION", "0"))
    versions = [int(v) for v in os.environ.get("WEREWOLF_LEAGUE", str(WARM_START)).split(",") if v.strip()]
    if not 0.0 <= fraction <= 1.0 or not versions:
        raise ValueError(
            "WEREWOLF_LEAGUE_FRACTION must be within [0, 1] and WEREWOLF_LEAGUE a comma-separated list of versions"
        )
    return fraction, versions


async def play(task: dict, llm: Any, client: Any, models: dict[str, str]) -> bool:
    """One vote with `models[team]` playing each team; True when the villagers win."""
    names = seat_names(task)

    async def vote(seat: int) -> int | None:
        team = VILLAGERS if rules.role(task, seat) == "villager" else WOLVES
        response = await client.with_options(base_url=llm.agent_url(names[seat])).chat.completions.create(
            model=models[team], messages=rules.messages(task, seat), temperature=1.0, max_tokens=MAX_TOKENS
        )
        return rules.parse_vote(response.choices[0].message.content, seat)

    ballots = await asyncio.gather(*(vote(seat) for seat in rules.SEATS))
    return rules.villagers_win(task, dict(zip(rules.SEATS, ballots, strict=True)))


async def agent(task: dict, llm: Any) -> dict[str, float]:
    from openai import AsyncOpenAI

    rules.check_game(task)
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)
    try:
        if str(task.get("id", "")).startswith("val-"):
            warm = {team: f"{team}@{WARM_START}" for team in (VILLAGERS, WOLVES)}
            villagers_won = await play(task, llm, client, {VILLAGERS: VILLAGERS, WOLVES: warm[WOLVES]})
            wolves_lost = await play(task, llm, client, {VILLAGERS: warm[VILLAGERS], WOLVES: WOLVES})
            return {VILLAGERS: float(villagers_won), WOLVES: float(not wolves_lost)}
        models = {VILLAGERS: VILLAGERS, WOLVES: WOLVES}
        fraction, versions = league()
        draw = random.Random(task["seed"])  # the same for every member of a GRPO group
        if draw.random() < fraction:
            frozen = draw.choice([VILLAGERS, WOLVES])
            models[frozen] = f"{frozen}@{draw.choice(versions)}"
        won = await play(task, llm, client, models)
        return {VILLAGERS: float(won), WOLVES: float(not won)}
    finally:
        await client.close()

"""The six seats of a one-day Werewolf vote, each an OpenAI-SDK caller; it knows nothing about squall.

    async def agent(task, llm) -> float

Every seat is its own agent with its own base URL (`llm.agent_url("seat3")`, so each call is
attributed to its seat) and sees only its private prompt (`game.prompt`). Villagers ask for
the policy (`llm.model`); wolves ask for the opponent's model name (`task["opponent_model"]`,
default "opponent"), which the run routes to a model that does not learn. All six vote at
once; reward 1.0 when the villagers vote a wolf out, else 0.0.

As an external command (the game as JSON on stdin, OPENAI_BASE_URL / OPENAI_API_KEY,
OPENAI_MODEL for the villagers, OPPONENT_MODEL for the wolves) it prints the reward:

    echo '{"seed": 1, "wolves": [2, 5], "clues": {"1": 2, "3": 5, "4": 2, "6": 5}}' | python -m examples.werewolf.agent
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from examples.werewolf import game as rules

OPPONENT_MODEL = "opponent"
MAX_TOKENS = 8  # a vote is one digit and the end token (a chat model may add a word)


async def agent(task: dict, llm: Any) -> float:
    """Play one game; the villagers' reward."""
    from openai import AsyncOpenAI

    rules.check_game(task)
    opponent = task.get("opponent_model") or OPPONENT_MODEL
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "none", max_retries=0)

    async def vote(seat: int) -> int | None:
        url = llm.agent_url(f"seat{seat}") if hasattr(llm, "agent_url") else llm.base_url
        model = opponent if rules.role(task, seat) == "wolf" else llm.model
        response = await client.with_options(base_url=url).chat.completions.create(
            model=model, messages=rules.messages(task, seat), temperature=1.0, max_tokens=MAX_TOKENS
        )
        return rules.parse_vote(response.choices[0].message.content, seat)

    try:
        ballots = await asyncio.gather(*(vote(seat) for seat in rules.SEATS))
    finally:
        await client.close()
    return 1.0 if rules.villagers_win(task, dict(zip(rules.SEATS, ballots, strict=True))) else 0.0


class _Endpoint:
    def __init__(self, base_url: str, model: str, api_key: str) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key


def main() -> int:
    if "OPENAI_BASE_URL" not in os.environ:
        print("set OPENAI_BASE_URL to the OpenAI-compatible endpoint", file=sys.stderr)
        return 2
    task = json.load(sys.stdin)
    task.setdefault("opponent_model", os.environ.get("OPPONENT_MODEL", OPPONENT_MODEL))
    llm = _Endpoint(os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_MODEL", "policy"),
                    os.environ.get("OPENAI_API_KEY", "none"))  # fmt: skip
    print(asyncio.run(agent(task, llm)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

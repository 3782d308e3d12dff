"""Agents for tests/test_runner_turn_rewards.py: turn-level rewards through the real gateway."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

from openai import AsyncOpenAI


async def _ask(client: AsyncOpenAI, llm, text: str) -> None:
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": text}], max_tokens=4, temperature=1.0
    )


async def agent(task: dict, llm) -> float | None:
    """behave: steps (two calls, a reward after each, plus an outcome), nan, early, retry."""
    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    behave = task["behave"]
    if behave == "early":
        llm.emit_reward(1.0)  # before any call: TurnRewardError fails this attempt
    await _ask(client, llm, "first")
    if behave == "nan":
        llm.emit_reward(float("nan"))
    llm.emit_reward(0.25)
    llm.emit_reward(0.5)  # two emits after one call add up on it
    await _ask(client, llm, "second")
    llm.emit_reward(0.125)
    return 2.0  # the outcome reward, on the last turn


def command_agent() -> None:
    """A command agent: one call, then POSTs its turn rewards, one of them bad."""
    base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
    reward_url = os.environ["AGENT_REWARD_URL"]
    assert reward_url == base + "/reward", reward_url

    def post(url: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Authorization": f"Bearer {key}"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, early = post(reward_url, {"reward": 1.0})
    assert status == 400 and "before any model call" in early["error"]["message"], early
    post(
        f"{base}/chat/completions",
        {
            "model": os.environ["OPENAI_MODEL"],
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
        },
    )
    status, bad = post(reward_url, {"reward": "Infinity"})
    assert status == 400 and "must be a number" in bad["error"]["message"], bad
    status, ok = post(reward_url, {"reward": 0.75})
    assert status == 200 and ok == {"turn": 0, "turn_reward": 0.75}, ok
    print("", file=sys.stdout)  # no outcome reward: the turn rewards are the attempt's reward


if __name__ == "__main__":
    command_agent()

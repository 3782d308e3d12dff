"""Agents used by the scheduler/runner/gateway tests (imported by runner subprocesses).

A payload's `behave` picks what the trivial agent does; nothing here talks to a model
unless its name says so.
"""

from __future__ import annotations

import asyncio
import time


async def trivial(task: dict, llm) -> float | None:
    """Reward from the row; `sleep` seconds of pretend work; `behave` for failure modes."""
    behave = task.get("behave", "ok")
    if task.get("sleep"):
        await asyncio.sleep(float(task["sleep"]))
    if behave == "raise":
        raise RuntimeError("agent exploded on purpose")
    if behave == "missing_module":  # an environment without a package the agent imports
        import squall_test_no_such_module  # type: ignore[import-not-found]  # noqa: F401
    if behave == "hang":
        await asyncio.sleep(3600)
    if behave == "nan":
        return float("nan")
    if behave == "none":
        return None
    if behave == "emit":
        llm.emit_reward(0.5)
        return None
    return float(task.get("reward", 1.0))


def sync_trivial(task: dict, llm) -> float:
    time.sleep(float(task.get("sleep", 0)))
    return float(task.get("reward", 1.0))


def answer_reward(task: dict, final_answer: str | None) -> float:
    """A reward_fn: 1 when the agent's final answer is non-empty."""
    return 1.0 if final_answer else 0.0


async def tiny_llm(task: dict, llm) -> float:
    """One short chat call through the gateway (real tokens to train on), `sleep` seconds of
    pretend work after it, and a random reward so that groups have variance."""
    import random

    import httpx

    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(
            f"{llm.base_url}/chat/completions",
            headers={"Authorization": f"Bearer {llm.api_key}"},
            json={
                "model": llm.model,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": task["question"]}],
            },
        )
        reply.raise_for_status()
    await asyncio.sleep(float(task.get("sleep", 0)))
    return random.random()

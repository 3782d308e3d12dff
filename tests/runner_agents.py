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

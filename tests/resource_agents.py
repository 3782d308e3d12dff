"""Agents of the resource and APO tests (imported by runner subprocesses); no model calls.

Their reward depends only on the system prompt they were handed, so a test knows exactly
which prompt earns what.
"""

from __future__ import annotations

import time


def keyword_reward(task: dict, llm) -> float:
    """The share of the row's `needs` words that the system prompt contains (case-insensitive)."""
    prompt = llm.resources.get("system_prompt", "").lower()
    needs = task.get("needs", [])
    return sum(word in prompt for word in needs) / len(needs) if needs else 0.0


def version_reward(task: dict, llm) -> float:
    """The version of the system prompt handed out, checked against its text (`… v<N>`);
    `sleep` seconds of pretend work first."""
    time.sleep(float(task.get("sleep", 0)))
    version = llm.resource_versions["system_prompt"]
    text = llm.resources["system_prompt"]
    if not text.endswith(f"v{version}"):
        raise RuntimeError(f"version {version} handed with text {text!r}")
    return float(version)

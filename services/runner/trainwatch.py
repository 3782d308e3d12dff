"""Watching `runner.train_agents` for names no call ever uses (with them, nothing trains).

A call is attributed to the agent whose URL it went to (`main` for the attempt's base URL), and
only calls of agents listed in `train_agents` train. A listed name that no call uses is most
often a typo, or an agent that calls `llm.base_url` instead of `llm.agent_url(name)`: the run
goes on and trains nothing of that agent, silently. So a runner counts, over the attempts it
finishes, which agents made calls; once it has finished `runner.train_agents_check_after`
attempts that made at least one call and a listed name is still not among them, it reports that
name, once (0: never checks).
Calls from other agents are what make the silence telling: an attempt with no call at all
(an agent that failed before calling) does not count.
"""

from __future__ import annotations

from collections import Counter

from squall.shared.schemas import Turn


class TrainAgentsWatch:
    def __init__(self, train_agents: list[str], after: int) -> None:
        self.train_agents = list(train_agents)
        self.after = after  # finished attempts with calls before the names are checked
        self.calls: Counter[str] = Counter()  # agent name -> calls seen in finished attempts
        self.attempts = 0  # finished attempts that made at least one call
        self.done = not self.train_agents or after == 0  # nothing to watch, or already decided

    def observe(self, turns: list[Turn]) -> list[str]:
        """Count one finished attempt's calls; the listed names no call used, the one time the
        threshold is reached (else [])."""
        if self.done or not turns:
            return []
        self.attempts += 1
        self.calls.update(turn.agent for turn in turns)
        if self.attempts < self.after:
            return []
        self.done = True
        return [name for name in self.train_agents if name not in self.calls]

    def message(self, name: str) -> str:
        seen = ", ".join(f"{agent} ({count} calls)" for agent, count in self.calls.most_common()) or "none"
        return (
            f"runner.train_agents lists {name!r}, but no call came from an agent of that name in "
            f"{self.attempts} finished attempts (calls came from: {seen}), so nothing of {name!r} "
            f"trains. Send that agent's calls to llm.agent_url({name!r}) (.../agent/{name}/v1), or "
            "fix the name in runner.train_agents ('main' is the attempt's base URL)."
        )

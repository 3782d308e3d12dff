"""Watching for an agent that fails every attempt (then nothing trains, and the run looks busy).

An agent that cannot run at all — a module its environment lacks, a wrong base URL, a bad
import inside the agent function — fails each attempt with the same exception. The scheduler
retries and dead-letters them as it should for a flaky agent, so the ledger moves, the services
stay up, and no step is ever trained. A runner counts the agent failures it finishes in a row
(status `failed` with no infrastructure cause; an `ok` attempt resets the count); after
`runner.agent_failing_after` of them it reports the run once, with the errors it saw (0: never).
Infrastructure failures (no policy node answered) are not the agent's and do not count.
"""

from __future__ import annotations

from collections import Counter


class AgentFailureWatch:
    def __init__(self, after: int) -> None:
        self.after = after  # agent failures in a row before it is reported
        self.errors: Counter[str] = Counter()  # error text -> times, in the current run of failures
        self.in_a_row = 0
        self.done = after == 0  # reported already, or never checked

    def observe(self, status: str, infra: str, error: str | None) -> bool:
        """Count one finished attempt; True the one time the failures in a row reach `after`."""
        if self.done or status == "skipped":
            return False
        if status == "ok":
            self.in_a_row = 0
            self.errors.clear()
            return False
        if status != "failed" or infra:
            return False  # a timeout may be slow inference; an infrastructure fault is not the agent's
        self.in_a_row += 1
        self.errors[(error or "no error text")[:300]] += 1
        if self.in_a_row < self.after:
            return False
        self.done = True
        return True

    def message(self, agent: str) -> str:
        (top, times), *others = self.errors.most_common()
        more = f" and {len(others)} other error(s)" if others else ""
        return (
            f"agent {agent!r} failed {self.in_a_row} attempts in a row on one runner, none succeeded "
            f"between them: {top!r} ({times} times){more}. Nothing trains while every attempt fails: "
            "they are retried, then dead-lettered. Fix the agent or its environment (the error "
            "names it: a missing module, a wrong URL, a bad argument), then restart the runners."
        )

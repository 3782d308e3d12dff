"""Reward functions for the rescore tests, with the `runner.reward_fn` contract
`fn(task, final_answer) -> float`."""

from __future__ import annotations

from examples.calc.agent import score


def calc(task: dict, final_answer: str | None) -> float:
    """The calculator agent's own reward: 1 when the reply's last integer is the answer."""
    return score(final_answer, task["answer"])


def length(task: dict, final_answer: str | None) -> float:
    """A different reward: shorter replies score higher."""
    return 1.0 / (1 + len(final_answer or ""))


def broken(task: dict, final_answer: str | None) -> float:
    raise KeyError("no such field")


not_callable = 3

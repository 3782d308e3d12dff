"""APO's pieces that do no I/O: the editor's two prompts, reading its replies, the beam.

The method is ProTeGi ("Automatic Prompt Optimization with 'Gradient Descent' and Beam
Search", Pryzant et al., EMNLP 2023): for each prompt in the beam, show the editor a few
attempts the prompt got wrong and ask why (the "textual gradient"), then ask for rewrites that
fix those reasons (the "step"); score every candidate on the same rows and keep the best
`beam_width`. What we leave out of the paper: its Monte-Carlo paraphrases of each rewrite and
its bandit selection (UCB / successive rejects) over candidates; every candidate here is scored
on the same `eval_samples` rows. The wording of the prompts is ours.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .editor import EditorGarbage

START, END = "<START>", "<END>"
_WRAPPED = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)
MAX_PROMPT_CHARS = 8000  # a rewrite longer than this is the editor rambling, not a prompt
SHOWN_CHARS = 600  # of a task and of an answer, per example shown to the editor


@dataclass
class Example:
    """One attempt shown to the editor: what the agent was given, what it answered, its reward."""

    task: dict[str, Any]
    answer: str
    reward: float


def _render(examples: list[Example]) -> str:
    lines = []
    for i, ex in enumerate(examples, 1):
        task = json.dumps(ex.task, ensure_ascii=False)[:SHOWN_CHARS]
        lines.append(
            f"Example {i}\nTask: {task}\nAgent's answer: {ex.answer[:SHOWN_CHARS]!r}\nReward: {ex.reward:g}"
        )
    return "\n\n".join(lines)


def critique_messages(prompt: str, examples: list[Example], reasons: int = 2) -> list[dict[str, str]]:
    """The gradient step: why did `prompt` earn low reward on these attempts?"""
    text = (
        "An agent follows the system prompt below to do tasks; each attempt earns a reward "
        "(higher is better).\n\n"
        f'Current system prompt:\n"""{prompt}"""\n\n'
        f"It earned low reward on these attempts:\n\n{_render(examples)}\n\n"
        f"Give {reasons} reasons why the prompt could have led to these low rewards. "
        f"Wrap each reason with {START} and {END}."
    )
    return [{"role": "user", "content": text}]


def rewrite_messages(
    prompt: str, examples: list[Example], critique: list[str], n: int
) -> list[dict[str, str]]:
    """The edit step: rewrites of `prompt` that fix what the critique found."""
    reasons = "\n".join(f"- {c}" for c in critique)
    text = (
        "An agent follows the system prompt below to do tasks; each attempt earns a reward "
        "(higher is better).\n\n"
        f'Current system prompt:\n"""{prompt}"""\n\n'
        f"It earned low reward on these attempts:\n\n{_render(examples)}\n\n"
        f"The problems with the prompt:\n{reasons}\n\n"
        f"Write {n} different improved system prompts that fix these problems. "
        f"Wrap each whole prompt with {START} and {END}."
    )
    return [{"role": "user", "content": text}]


def wrapped(reply: str, at_most: int) -> list[str]:
    """The <START>…<END> pieces of a reply, stripped, non-empty, distinct, at most `at_most`;
    EditorGarbage when there are none (the editor did not answer in the asked form)."""
    found: list[str] = []
    for piece in _WRAPPED.findall(reply):
        piece = piece.strip().strip('"').strip()
        if piece and len(piece) <= MAX_PROMPT_CHARS and piece not in found:
            found.append(piece)
    if not found:
        raise EditorGarbage(f"no {START}…{END} piece in the reply {reply[:200]!r}")
    return found[:at_most]


@dataclass
class Scored:
    """A prompt version and its mean reward on the evaluation rows."""

    version: int
    score: float

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "score": self.score}


def keep_beam(scored: list[Scored], width: int) -> list[Scored]:
    """The best `width` prompts; on a tie the older version (lower number) stays, so a rewrite
    must do better, not merely as well, to push out what is already there."""
    return sorted(scored, key=lambda s: (-s.score, s.version))[:width]


def should_promote(best: Scored, current: Scored, min_improvement: float) -> bool:
    """Does `best` replace the current prompt?"""
    return best.version != current.version and best.score > current.score + min_improvement

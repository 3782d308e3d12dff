"""Trajectory turns -> training samples, and samples -> padded batch tensors.

A sample is one token sequence with a per-token loss mask and the behaviour logprobs the
inference server returned. Arrays line up index for index: ``input_ids[t]`` is a token,
``loss_mask[t]`` is 1 when that token was sampled by the trained policy (so its logprob at
position t-1 enters the loss), ``behaviour_logprobs[t]`` is the logprob it was sampled with
(0 where the mask is 0).

Merging: the trained turns of one agent are walked in call order. When turn k+1's prompt
extends turn k's prompt+response token for token, turn k+1 continues the same sequence: the
tokens between (tool results, observations, the next user message) are appended with mask 0
and its response with mask 1. Otherwise (a re-tokenised or rewritten history) a new sample
starts - it shares the trajectory's advantage - and the mismatch is counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from squall.shared.schemas import Trajectory


class OutOfVocab(ValueError):
    """A token id is >= the model's vocabulary size: the trajectory cannot be trained."""


@dataclass
class Sample:
    """One training sequence."""

    key: str  # trajectory key task_id#attempt
    group_id: str
    input_ids: np.ndarray  # (T,) int32
    loss_mask: np.ndarray  # (T,) float32, 1 on trained response tokens
    behaviour_logprobs: np.ndarray  # (T,) float32, 0 where loss_mask is 0
    advantage: float = 0.0  # the trajectory's advantage, given to every trained token
    # Turn-level estimators: (T,) float32, each token's own turn's advantage (None: `advantage`
    # on every token).
    advantages: np.ndarray | None = None
    sft: bool = False  # its trained tokens take the SFT loss (negative log-likelihood), not PPO

    def token_advantages(self) -> np.ndarray:
        """(T,) the advantage of each token (0 matters nowhere the loss mask is 0)."""
        if self.advantages is not None:
            return self.advantages
        return np.full(self.length, self.advantage, np.float32)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class SplitStats:
    """What turning trajectories into samples found."""

    samples: int = 0
    merged_turns: int = 0  # turns appended to the previous turn's sequence
    mismatches: int = 0  # trained turns of one agent whose prompt did not extend the history
    masked_truncated: int = 0  # turns with finish_reason 'length' masked out of the loss
    per_key: dict[str, int] = field(default_factory=dict)


def check_vocab(trajectory: Trajectory, vocab_size: int) -> None:
    """Raise OutOfVocab naming the turn and the id when any token id >= vocab_size."""
    for i, turn in enumerate(trajectory.turns):
        for name, ids in (("prompt", turn.prompt_tokens), ("response", turn.response_tokens)):
            if ids.size and int(ids.max()) >= vocab_size:
                raise OutOfVocab(
                    f"trajectory {trajectory.key} turn {i}: {name} token id {int(ids.max())} "
                    f">= vocab size {vocab_size}"
                )


def _extends(history: np.ndarray, prompt: np.ndarray) -> bool:
    return prompt.shape[0] >= history.shape[0] and bool(np.array_equal(prompt[: history.shape[0]], history))


def trajectory_to_samples(
    trajectory: Trajectory,
    *,
    advantage: float = 0.0,
    mask_truncated: bool = False,
    stats: SplitStats | None = None,
    turn_advantages: Sequence[float] | None = None,
) -> list[Sample]:
    """The trained turns of one trajectory -> samples (merged where prompts extend).

    Only turns with ``trained=True`` contribute; with ``mask_truncated`` the responses of
    turns that stopped on 'length' stay in the sequence with mask 0. With ``turn_advantages``
    (one per turn of the trajectory) each response token carries its own turn's advantage.
    """
    if turn_advantages is not None and len(turn_advantages) != len(trajectory.turns):
        raise ValueError(
            f"trajectory {trajectory.key}: {len(turn_advantages)} turn advantages for {len(trajectory.turns)} turns"
        )
    stats = stats if stats is not None else SplitStats()
    # agent -> [ids parts, mask parts, logprob parts, advantage parts]
    open_chains: dict[str, list[list[np.ndarray]]] = {}
    histories: dict[str, np.ndarray] = {}
    finished: list[list[list[np.ndarray]]] = []
    for k, turn in enumerate(trajectory.turns):
        if not turn.trained:
            continue
        turn_adv = float(turn_advantages[k]) if turn_advantages is not None else float(advantage)
        prompt, response, logprobs = turn.prompt_tokens, turn.response_tokens, turn.logprobs
        resp_mask = (
            np.zeros(response.shape[0], np.float32)
            if (mask_truncated and turn.finish_reason == "length")
            else np.ones(response.shape[0], np.float32)
        )
        if mask_truncated and turn.finish_reason == "length":
            stats.masked_truncated += 1
        resp_lp = np.where(resp_mask > 0, logprobs, 0.0).astype(np.float32)
        resp_adv = np.full(response.shape[0], turn_adv, np.float32)
        history = histories.get(turn.agent)
        if history is not None and _extends(history, prompt):
            gap = prompt[history.shape[0] :]
            chain = open_chains[turn.agent]
            chain[0] += [gap, response]
            chain[1] += [np.zeros(gap.shape[0], np.float32), resp_mask]
            chain[2] += [np.zeros(gap.shape[0], np.float32), resp_lp]
            chain[3] += [np.zeros(gap.shape[0], np.float32), resp_adv]
            stats.merged_turns += 1
        else:
            if history is not None:
                stats.mismatches += 1
                finished.append(open_chains[turn.agent])
            open_chains[turn.agent] = [
                [prompt, response],
                [np.zeros(prompt.shape[0], np.float32), resp_mask],
                [np.zeros(prompt.shape[0], np.float32), resp_lp],
                [np.zeros(prompt.shape[0], np.float32), resp_adv],
            ]
        histories[turn.agent] = np.concatenate([prompt, response])
    finished.extend(open_chains.values())
    samples = [
        Sample(
            key=trajectory.key,
            group_id=trajectory.group_id,
            input_ids=np.concatenate(ids).astype(np.int32),
            loss_mask=np.concatenate(mask),
            behaviour_logprobs=np.concatenate(lp),
            advantage=float(advantage),
            advantages=np.concatenate(adv) if turn_advantages is not None else None,
        )
        for ids, mask, lp, adv in finished
    ]
    samples = [s for s in samples if s.length >= 2]
    stats.samples += len(samples)
    stats.per_key[trajectory.key] = len(samples)
    return samples


def token_weights(samples: Sequence[Sample], loss_agg: str) -> list[np.ndarray]:
    """Per-token loss weights (each (T_i,)) so that the weighted sum is the step's loss.

    token: every trained token of the step weighs 1/(trained tokens in the step).
    trajectory: each trajectory weighs 1/(trajectories), spread over its own trained tokens
    (a trajectory split into several samples still counts once).
    """
    if loss_agg == "token":
        total = sum(s.trained_tokens for s in samples) or 1
        return [s.loss_mask / total for s in samples]
    if loss_agg == "trajectory":
        per_key: dict[str, int] = {}
        for s in samples:
            per_key[s.key] = per_key.get(s.key, 0) + s.trained_tokens
        n_traj = sum(1 for v in per_key.values() if v) or 1
        return [s.loss_mask / (max(per_key[s.key], 1) * n_traj) for s in samples]
    raise ValueError(f"unknown loss_agg {loss_agg!r}: known are token, trajectory")


def pack_microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that each group's (count x longest) padded size stays <= max_tokens.

    Longest first, so padding is small; a sample longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        candidate = max(longest, lengths[i])
        if current and candidate * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
            candidate = lengths[i]
        current.append(i)
        longest = candidate
    if current:
        batches.append(current)
    return batches


def collate(
    samples: Sequence[Sample], weights: Sequence[np.ndarray], pad_id: int = 0
) -> dict[str, np.ndarray]:
    """Samples -> right-padded arrays, shifted so index t is the prediction of token t+1.

    Returns input_ids (B, T) int64, attention_mask (B, T), and for targets (B, T-1):
    targets, loss_mask, behaviour_logprobs, weights, advantages, sft_mask (1 on SFT tokens).
    """
    batch, width = len(samples), max(s.length for s in samples)
    ids = np.full((batch, width), pad_id, np.int64)  # (B, T)
    attn = np.zeros((batch, width), np.int64)  # (B, T)
    mask = np.zeros((batch, width), np.float32)
    blp = np.zeros((batch, width), np.float32)
    wts = np.zeros((batch, width), np.float32)
    adv = np.zeros((batch, width), np.float32)
    sft = np.zeros((batch, width), np.float32)
    for b, (s, w) in enumerate(zip(samples, weights, strict=True)):
        n = s.length
        ids[b, :n] = s.input_ids
        attn[b, :n] = 1
        mask[b, :n] = s.loss_mask
        blp[b, :n] = s.behaviour_logprobs
        wts[b, :n] = w
        adv[b, :n] = s.token_advantages()
        sft[b, :n] = s.loss_mask if s.sft else 0.0
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "targets": ids[:, 1:],  # (B, T-1)
        "loss_mask": mask[:, 1:],
        "behaviour_logprobs": blp[:, 1:],
        "weights": wts[:, 1:],
        "advantages": adv[:, 1:],
        "sft_mask": sft[:, 1:],
    }

"""SFT from the run's own traces: filtered behaviour cloning on successful trajectories.

A member trains by supervised fine-tuning when its reward is >= `trainer.sft_threshold` and
its trained tokens were not seen before in this process (dedup by a hash of every trained
turn's prompt and response ids). Its samples are the same as GRPO's (sequences.py): only
turns of trained agents, loss mask 1 only on the tokens the policy sampled, so prompts,
tool results and frozen agents' text never carry loss. The loss on those tokens is the
negative log-likelihood (losses.py, `sft_mask`), weighted by `trainer.sft_coef`.

Modes (`trainer.sft`):
- "off":  GRPO only (today's trainer);
- "only": SFT alone: members below the threshold are filtered (`sft_below_threshold`),
          zero-variance groups (all members succeeded) train too;
- "mix":  one step holds GRPO samples (groups with signal) and SFT samples (successful
          members, also of zero-variance groups), the SFT term weighted by sft_coef.
With `trainer.sft_until_step` > 0, SFT stops at that optimizer step and GRPO alone goes on
(SFT first, then GRPO, in one run).

The groups, filters, commits and acks are the GRPO path's own (bookkeeping.py): a member is
trained or consumed exactly once whether it went into the step as GRPO, SFT or both. The dedup
set lives in memory: after a restart a trajectory whose twin trained before the crash may
train once more (it is a different attempt, never the same key twice).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from squall.shared.ledger import FilterReason
from squall.shared.schemas import Trajectory

from .filters import GroupDecision
from .sequences import Sample, SplitStats, trajectory_to_samples

MODES = ("off", "only", "mix")


def trained_hash(trajectory: Trajectory) -> str:
    """A digest of the trained turns' (agent, prompt ids, response ids), in call order."""
    digest = hashlib.blake2b(digest_size=16)
    for turn in trajectory.turns:
        if turn.trained:
            digest.update(turn.agent.encode() + b"\0")
            digest.update(len(turn.prompt_ids).to_bytes(8, "little") + turn.prompt_ids)
            digest.update(len(turn.response_ids).to_bytes(8, "little") + turn.response_ids)
    return digest.hexdigest()


@dataclass
class SftSelector:
    """Marks which members of a decided group train by SFT (GroupDecision.sft)."""

    mode: str = "off"
    threshold: float = 1.0
    seen: set[str] = field(default_factory=set)  # trained_hash of every member chosen so far

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown trainer.sft mode {self.mode!r}: known are {', '.join(MODES)}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def mark(self, decision: GroupDecision) -> GroupDecision:
        """Add SFT members to `decision` (from those that passed the other filters) and, in
        "only" mode, drop the GRPO advantages; members with nothing to train are filtered."""
        if not self.enabled:
            return decision
        if self.mode == "only":
            decision.advantages = {}
            decision.turn_advantages = {}
        keep = []
        for traj in decision.train:
            reward = float(traj.reward) if traj.reward is not None else float("-inf")
            digest = trained_hash(traj)
            if reward >= self.threshold and digest not in self.seen:
                self.seen.add(digest)
                decision.sft.add(traj.key)
            if traj.key in decision.sft or traj.key in decision.advantages:
                keep.append(traj)
            elif reward < self.threshold:
                # "mix": a zero-variance group's member with no SFT signal either.
                reason = (
                    FilterReason.SFT_BELOW_THRESHOLD if self.mode == "only" else FilterReason.ZERO_VARIANCE
                )
                decision.drop(reason.value, traj)
            else:
                decision.drop(FilterReason.SFT_DUPLICATE.value, traj)
        decision.train = keep
        return decision


def sft_samples(
    trajectory: Trajectory, *, mask_truncated: bool, stats: SplitStats | None = None
) -> list[Sample]:
    """The trajectory's samples (trained agents' turns, mask on sampled tokens) marked SFT."""
    samples = trajectory_to_samples(trajectory, mask_truncated=mask_truncated, stats=stats)
    for sample in samples:
        sample.sft = True
    return samples


def active(selector: SftSelector, step: int, until_step: int) -> bool:
    """Whether SFT is on at optimizer step `step` (trainer.sft_until_step: 0 = always)."""
    return selector.enabled and not (until_step and step >= until_step)

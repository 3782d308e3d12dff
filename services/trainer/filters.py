"""Which members of a complete group train, and why the others do not. Pure: no I/O.

Order, per group (members = every attempt the group received, one per member index):
1. status != ok (failed, timeout, cancelled)        -> filtered:<status>
2. fewer than 2 ok members, or all ok rewards equal -> filtered:zero_variance (no signal)
3. advantages over *all* ok members (the baseline uses every valid reward, including
   members filtered below: a stale or truncated attempt is still an unbiased sample of the
   group's reward)
4. per ok member: transition caps (caps.py) untrain turns; dropped turns are counted
                  (capped:<cap>), and a member left with none -> filtered:no_turns_in_cap
                  no trained turn                   -> filtered:no_trained_turns
                  trainer version - oldest turn version > max_staleness -> filtered:stale
                  a truncated turn (finish 'length') and overlong='drop' -> filtered:overlong
                  longer than max_seq_len tokens and overlong != 'keep'  -> filtered:overlong
With overlong='mask' truncated turns stay in the sequence with loss mask 0 (sequences.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from squall.shared.ledger import FilterReason
from squall.shared.schemas import Trajectory

from .advantages import get_advantage_fn, turn_advantages
from .caps import TurnCaps, apply_caps

ZERO_VARIANCE_TOL = 1e-8


@dataclass
class GroupDecision:
    """One group's outcome: members to train with their advantage, the rest by reason."""

    group_id: str
    train: list[Trajectory] = field(default_factory=list)
    advantages: dict[str, float] = field(default_factory=dict)  # key -> advantage (all ok members)
    # Turn-level estimators (advantage 'turn_*'): key -> one advantage per turn of the trajectory;
    # `advantages` then holds each member's first-turn advantage (its whole return), for metrics.
    turn_advantages: dict[str, list[float]] = field(default_factory=dict)
    sft: set[str] = field(default_factory=set)  # keys that also train by SFT (sft.py)
    filtered: dict[str, list[Trajectory]] = field(default_factory=dict)  # reason -> members
    staleness: list[int] = field(default_factory=list)  # per ok member with a served turn
    rewards: list[float] = field(default_factory=list)  # every ok member's reward
    capped: Counter = field(default_factory=Counter)  # turns untrained by the caps, by metric name

    def drop(self, reason: str, trajectory: Trajectory) -> None:
        self.filtered.setdefault(reason, []).append(trajectory)


def staleness_of(trajectory: Trajectory, trainer_version: int) -> int | None:
    """Versions between the trainer and the oldest policy version that served a trained turn."""
    versions = [t.version for t in trajectory.turns if t.trained and t.version >= 0]
    return trainer_version - min(versions) if versions else None


def is_truncated(trajectory: Trajectory) -> bool:
    return any(t.trained and t.finish_reason == "length" for t in trajectory.turns)


def sequence_tokens(trajectory: Trajectory) -> int:
    """Upper bound of one merged sequence's length: the last trained turn's prompt + response."""
    trained = [t for t in trajectory.turns if t.trained]
    if not trained:
        return 0
    return max((len(t.prompt_ids) + len(t.response_ids)) // 4 for t in trained)


def rewards_per_turn(trajectory: Trajectory) -> list[float]:
    """The reward following each turn: what the agent emitted after it, and the outcome
    reward (the attempt's reward minus everything emitted) on the last turn. A trajectory with
    no turns -> [its reward]. The list sums to the attempt's reward."""
    reward = float(trajectory.reward or 0.0)
    if not trajectory.turns:
        return [reward]
    per_turn = [float(t.reward) if t.reward is not None else 0.0 for t in trajectory.turns]
    emitted = [t.reward for t in trajectory.turns if t.reward is not None]
    # Only what was not emitted lands on the last turn: a single emit after the last call
    # then leaves it exactly as emitted (reward - reward == 0.0 in floats).
    per_turn[-1] += reward - float(sum(emitted)) if emitted else reward
    return per_turn


def _advantages(
    ok: list[Trajectory], group_id: str, advantage: str, turn_gamma: float, decision: GroupDecision
) -> None:
    if advantage.startswith("turn_"):
        per_turn = turn_advantages(
            [rewards_per_turn(t) for t in ok],
            [group_id] * len(ok),
            base=advantage.removeprefix("turn_"),
            gamma=turn_gamma,
        )
        decision.turn_advantages = {t.key: a for t, a in zip(ok, per_turn, strict=True)}
        decision.advantages = {t.key: (a[0] if a else 0.0) for t, a in zip(ok, per_turn, strict=True)}
        return
    rewards = [float(t.reward) for t in ok]  # type: ignore[arg-type]
    values = get_advantage_fn(advantage)(rewards, [group_id] * len(ok))
    decision.advantages = {t.key: a for t, a in zip(ok, values, strict=True)}


def decide_group(
    group_id: str,
    members: Sequence[Trajectory],
    *,
    trainer_version: int,
    max_staleness: int,
    overlong: str,
    max_seq_len: int,
    advantage: str = "grpo",
    caps: TurnCaps | None = None,
    turn_gamma: float = 1.0,
    keep_zero_variance: bool = False,
) -> GroupDecision:
    """With `keep_zero_variance` (SFT on: sft.py) a group without reward variance is not
    dropped: its members go through the other filters with no advantage, for SFT to pick."""
    decision = GroupDecision(group_id)
    ok = []
    for traj in members:
        if traj.status != "ok" or traj.reward is None:
            decision.drop(traj.status if traj.status != "ok" else "failed", traj)
        else:
            ok.append(traj)
    rewards = [float(t.reward) for t in ok]  # type: ignore[arg-type]
    decision.rewards = rewards
    if not ok or len(ok) < 2 or max(rewards) - min(rewards) <= ZERO_VARIANCE_TOL:
        if not keep_zero_variance:
            for traj in ok:
                decision.drop("zero_variance", traj)
            return decision
    else:
        _advantages(ok, group_id, advantage, turn_gamma, decision)
    for original in ok:
        traj, dropped = apply_caps(original, caps or TurnCaps())
        decision.capped.update(dropped)
        staleness = staleness_of(traj, trainer_version)
        if staleness is not None:
            decision.staleness.append(staleness)
        if staleness is None and dropped:
            decision.drop(FilterReason.NO_TURNS_IN_CAP.value, traj)
        elif staleness is None:
            decision.drop(FilterReason.NO_TRAINED_TURNS.value, traj)
        elif staleness > max_staleness:
            decision.drop(FilterReason.STALE.value, traj)
        elif (
            overlong == "drop"
            and is_truncated(traj)
            or overlong != "keep"
            and sequence_tokens(traj) > max_seq_len
        ):
            decision.drop(FilterReason.OVERLONG.value, traj)
        else:
            decision.train.append(traj)
    return decision

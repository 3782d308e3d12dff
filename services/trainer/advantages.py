"""Advantage estimators: pure functions, one scalar per *trajectory*, looked up by name.

Shapes: ``rewards`` is (N,) one reward per trajectory, ``group_ids`` is (N,) the group each
trajectory belongs to; the result is (N,) one advantage per trajectory, given later to every
trained token of that trajectory. The baseline is always taken over the *trajectories* of a
group, never over turns or tokens: a trajectory with 10 turns weighs exactly as much in its
group's mean and std as one with a single turn (the multi-turn bug where per-turn rows
entered the group statistics is impossible here because turns never reach these functions).

Std is the *population* std (divide by n). verl's GRPO uses ``torch.std`` (sample std, n-1),
which differs by sqrt(n/(n-1)) - a constant per group size that the learning rate absorbs.
A group of one gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

AdvantageFn = Callable[..., list[float]]


def _group_index(group_ids: Sequence[Any]) -> tuple[np.ndarray, int]:
    """(N,) group ids -> (N,) dense group index, number of groups."""
    _, inverse = np.unique(np.asarray([str(g) for g in group_ids]), return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1 if inverse.size else 0


def _check(rewards: Sequence[float], group_ids: Sequence[Any]) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.shape[0] != len(group_ids):
        raise ValueError(f"{r.shape[0]} rewards but {len(group_ids)} group ids: one of each per trajectory")
    if r.size and not np.isfinite(r).all():
        raise ValueError("rewards hold NaN or infinity")
    return r


def grpo_advantages(
    rewards: Sequence[float], group_ids: Sequence[Any], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps) over the trajectories of i's group g.

    rewards (N,), group_ids (N,) -> (N,). Population std. With ``scale_by_std=False`` this is
    Dr.GRPO (mean-centred only). Groups of one get 0.
    """
    r = _check(rewards, group_ids)
    if r.size == 0:
        return []
    idx, n_groups = _group_index(group_ids)
    count = np.bincount(idx, minlength=n_groups).astype(np.float64)  # (G,)
    mean = np.bincount(idx, weights=r, minlength=n_groups) / count  # (G,)
    centred = r - mean[idx]  # (N,)
    if scale_by_std:
        var = np.bincount(idx, weights=centred**2, minlength=n_groups) / count  # (G,)
        centred = centred / (np.sqrt(var)[idx] + eps)
    centred[count[idx] < 2] = 0.0
    return centred.tolist()


def drgrpo_advantages(rewards: Sequence[float], group_ids: Sequence[Any], **_: Any) -> list[float]:
    """Dr.GRPO (Liu et al. 2025): A_i = R_i - mean_g R, no std scaling. (N,) -> (N,)."""
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


def rloo_advantages(rewards: Sequence[float], group_ids: Sequence[Any], **_: Any) -> list[float]:
    """RLOO: A_i = R_i - mean of the *other* members of i's group. (N,) -> (N,).

    Equals n/(n-1) * (R_i - mean_g R). Groups of one get 0.
    """
    r = _check(rewards, group_ids)
    if r.size == 0:
        return []
    idx, n_groups = _group_index(group_ids)
    count = np.bincount(idx, minlength=n_groups).astype(np.float64)
    total = np.bincount(idx, weights=r, minlength=n_groups)
    n = count[idx]
    out = np.zeros_like(r)
    many = n >= 2
    out[many] = r[many] - (total[idx][many] - r[many]) / (n[many] - 1)
    return out.tolist()


ADVANTAGE_FNS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator called `name`; an unknown name raises ValueError listing the known ones."""
    try:
        return ADVANTAGE_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}: known are {', '.join(sorted(ADVANTAGE_FNS))}"
        ) from None


# --- turn-level rewards -------------------------------------------------------------------
# A trajectory's rewards per turn: r_k is what the agent emitted after turn k (llm.emit_reward),
# and the attempt's outcome reward (returned, or reward_fn's) sits on its last turn. The
# estimators below give every turn k of trajectory i its own advantage
#
#     A_ik = (G_ik - b_i) / s                G_ik = sum_{j >= k} gamma^(j-k) r_ij
#
# with one baseline b_i per trajectory, taken from the *whole-trajectory* returns G_j0 of its
# group (never from the returns of the other members at the same turn index: those are reached
# from different states, and how many members reach index k depends on the actions taken; the
# verl RFC #7244 shows that normalising per turn index is biased). The derivation is in
# docs/trainer.md. `base` picks b and s exactly as the trajectory-level estimator of that name
# does with G_j0 as the rewards, so a trajectory whose only reward is its last one, with
# gamma = 1, gets the trajectory-level advantage on every turn, bit for bit.
TURN_BASES = ("grpo", "drgrpo", "rloo")


def turn_returns(turn_rewards: Sequence[float], gamma: float = 1.0) -> np.ndarray:
    """(K,) rewards following each turn -> (K,) discounted return-to-go G_k."""
    r = np.asarray(turn_rewards, dtype=np.float64).reshape(-1)
    out = np.zeros_like(r)
    running = 0.0
    for k in range(r.shape[0] - 1, -1, -1):
        running = r[k] + gamma * running if k < r.shape[0] - 1 else r[k]
        out[k] = running
    return out


def turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[Any],
    *,
    base: str = "rloo",
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-turn advantages: N trajectories' (K_i,) turn rewards -> N lists of (K_i,) advantages.

    base grpo:   A_ik = (G_ik - mean_g G_0) / (std_g G_0 + eps)
    base drgrpo: A_ik = G_ik - mean_g G_0
    base rloo:   A_ik = G_ik - mean of G_j0 over the *other* members j of i's group
    A trajectory with no turns gets [] and still counts in its group's baseline with G_0 = 0.
    Groups of one get 0 on every turn.
    """
    if base not in TURN_BASES:
        raise ValueError(f"unknown turn advantage base {base!r}: known are {', '.join(TURN_BASES)}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"turn gamma {gamma} must be in (0, 1]")
    if len(turn_rewards) != len(group_ids):
        raise ValueError(f"{len(turn_rewards)} reward lists but {len(group_ids)} group ids")
    returns = [turn_returns(r, gamma) for r in turn_rewards]
    for i, g in enumerate(returns):
        if g.size and not np.isfinite(g).all():
            raise ValueError(f"turn rewards of trajectory {i} hold NaN or infinity")
    whole = np.asarray([g[0] if g.size else 0.0 for g in returns], dtype=np.float64)  # (N,)
    if whole.size == 0:
        return []
    idx, n_groups = _group_index(group_ids)
    count = np.bincount(idx, minlength=n_groups).astype(np.float64)  # (G,)
    total = np.bincount(idx, weights=whole, minlength=n_groups)  # (G,)
    mean = total / count
    n = count[idx]  # (N,)
    if base == "rloo":
        baseline = np.where(n >= 2, (total[idx] - whole) / np.maximum(n - 1, 1), 0.0)
        scale = np.ones_like(whole)
    else:
        baseline = mean[idx]
        scale = np.ones_like(whole)
        if base == "grpo":
            var = np.bincount(idx, weights=(whole - mean[idx]) ** 2, minlength=n_groups) / count
            scale = np.sqrt(var)[idx] + eps
    out = []
    for i, g in enumerate(returns):
        if n[i] < 2:
            out.append([0.0] * g.shape[0])
        else:
            out.append(((g - baseline[i]) / scale[i]).tolist())
    return out

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

"""Policy-gradient loss: PPO-clip on the ratio to the behaviour policy, with truncated
importance sampling, optional k3 KL to a frozen reference. Pure functions on tensors.

Shapes: B sequences, T target positions. Every (B, T) tensor lines up with the shifted
targets of ``sequences.collate``.

The loss per token (A = advantage, r = exp(logp - behaviour_logp)):

    unclipped = -A * min(r, tis_cap) * exp(logp - sg(logp))   # value -A*min(r, C), grad weight min(r, C)
    clipped   = -A * clip(r, 1 - clip_low, 1 + clip_high)
    loss_t    = max(unclipped, clipped) + kl_coef * k3(logp, ref_logp)

so the importance weight to the behaviour policy (the server that sampled the token, often
some versions behind) is truncated at ``tis_cap`` as in TIS (Yao et al. 2025) - the gradient
keeps a bounded weight instead of vanishing - while the PPO clip still stops the update
where the ratio already moved past 1 +/- clip in the advantage's direction. The step's loss
is sum_t weights_t * loss_t (the weights carry the token/trajectory normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    loss: torch.Tensor  # () weighted sum, differentiable
    pg_loss: float  # weighted sum of the policy term alone
    kl: float  # mean k3 KL over trained tokens (0 without reference)
    clip_fraction: float  # share of trained tokens where the clipped branch was active
    tis_fraction: float  # share of trained tokens whose ratio was truncated at tis_cap
    ratio_mean: float  # mean r over trained tokens
    tokens: int  # trained tokens


# Positions per chunk when reducing logits over the vocabulary: bounds the float32 working copy
# to chunk x V. Whole, at 16k tokens x Qwen2's 152k vocabulary, that copy alone is 10 GB (and
# log_softmax's output another 10): a 0.5B step peaked at 63 GiB on an H100 before chunking.
LOGIT_CHUNK = 2048


def _picked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N,) targets -> log p(target) in float32."""
    chunk = logits.float()
    return chunk.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(chunk, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets (B, T) -> log p(target) (B, T), in float32.

    Row by row, LOGIT_CHUNK positions at a time (unbind/split views, whose backward assembles
    one gradient instead of a zero-filled copy per slice); with gradients, each chunk is
    recomputed in backward (activation checkpointing) instead of keeping its float32 copy."""
    from torch.utils.checkpoint import checkpoint

    differentiable = logits.requires_grad and torch.is_grad_enabled()
    rows = []
    for row_logits, row_targets in zip(logits.unbind(0), targets.unbind(0), strict=True):
        pieces = [
            checkpoint(_picked_logprobs, chunk, picked, use_reentrant=False)
            if differentiable
            else _picked_logprobs(chunk, picked)
            for chunk, picked in zip(
                row_logits.split(LOGIT_CHUNK), row_targets.split(LOGIT_CHUNK), strict=True
            )
        ]
        rows.append(torch.cat(pieces) if pieces else row_targets.new_zeros(0, dtype=torch.float32))
    if not rows:
        return torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    return torch.stack(rows)


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V) -> entropy of each position's distribution (B, T), chunk by chunk."""
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for row, row_logits in enumerate(logits.unbind(0)):
        for start in range(0, row_logits.shape[0], LOGIT_CHUNK):
            logp = torch.log_softmax(row_logits[start : start + LOGIT_CHUNK].float(), dim=-1)
            out[row, start : start + LOGIT_CHUNK] = -(logp.exp() * logp).sum(-1)
    return out


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1, (B, T)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def ppo_tis_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The policy term per token, unweighted: (pg (B, T) differentiable, ratio (B, T), clip
    active (B, T) bool). Both backends use it (verl's through a registered policy loss)."""
    log_ratio = (logp - behaviour_logp).clamp(-20.0, 20.0)  # keep exp finite on masked junk
    ratio = torch.exp(log_ratio)  # (B, T)
    is_weight = torch.clamp(ratio.detach(), max=tis_cap)
    unclipped = -advantages * is_weight * torch.exp(logp - logp.detach())
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)  # (B, T)
    return pg, ratio, (clipped > unclipped).detach()


def ppo_tis_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    sft_mask: torch.Tensor | None = None,
    sft_coef: float = 1.0,
) -> LossOutput:
    """All inputs (B, T); logp carries the gradient. Returns the weighted loss and stats.
    Where `sft_mask` is 1 the policy term is the SFT one, -sft_coef * logp (trainer/sft.py)."""
    mask = loss_mask > 0
    n = int(mask.sum())
    pg, ratio, clip_active = ppo_tis_token_loss(
        logp, behaviour_logp, advantages, clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap
    )
    if sft_mask is not None and bool((sft_mask > 0).any()):
        pg = torch.where(sft_mask > 0, -sft_coef * logp, pg)
        clip_active = clip_active & (sft_mask <= 0)
    pg_loss = (pg * weights).sum()
    loss = pg_loss
    kl_mean = 0.0
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        if kl_coef:
            loss = loss + kl_coef * (kl * weights).sum()
        kl_mean = float(kl.detach()[mask].mean()) if n else 0.0
    with torch.no_grad():
        clip_active = clip_active & mask
        truncated = (ratio > tis_cap) & mask
        return LossOutput(
            loss=loss,
            pg_loss=float(pg_loss.detach()),
            kl=kl_mean,
            clip_fraction=float(clip_active.sum()) / n if n else 0.0,
            tis_fraction=float(truncated.sum()) / n if n else 0.0,
            ratio_mean=float(ratio[mask].mean()) if n else 0.0,
            tokens=n,
        )

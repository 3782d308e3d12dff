"""Token sampling for the torch engine: temperature, top_p and the temperature-1 logprob.

Pure tensor code. Randomness comes in as one uniform number per row, drawn by the caller from
that sequence's own seeded generator, so a seeded choice samples the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    logits (B, V) raw model output; temperature (B,), 0 = greedy; top_p (B,) in (0, 1];
    uniforms (B,) in [0, 1). Returns tokens (B,) int64 and their logprobs (B,) float32 under
    softmax(logits) — temperature 1, before top_p — which is what the trainer's ratio needs.
    """
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    greedy = temperature <= 0
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)  # (B, V)
    if bool((top_p < 1).any()):
        probs, order = probs.sort(dim=-1, descending=True)  # (B, V)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs * (mass_before < top_p[:, None])  # the smallest prefix holding top_p
    else:
        order = None
    cdf = probs.cumsum(dim=-1)  # (B, V)
    target = uniforms.to(cdf.dtype) * cdf[:, -1]
    choice = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)  # (B, 1)
    tokens = choice[:, 0] if order is None else order.gather(1, choice)[:, 0]
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, raw_logprobs.gather(1, tokens[:, None])[:, 0]


def reference_sample(logits: torch.Tensor, temperature: float, top_p: float, u: float) -> int:
    """One row, written plainly: the definition `sample` is tested against."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    ranked = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    total = sum(float(probs[i]) for i in kept)
    running = 0.0
    for i in kept:
        running += float(probs[i]) / total
        if u < running:
            return i
    return kept[-1]

"""The loss against a plain reference on random inputs, across seeds: PPO-clip with asymmetric
clip and TIS, token/trajectory normalisation, k3 KL, entropy, and the reported fractions.
The reference is a loop over tokens in Python floats with the gradient written by hand."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from squall.trainer.losses import ppo_tis_loss, token_entropy, token_logprobs
from squall.trainer.sequences import Sample, token_weights

CLIP_LOW, CLIP_HIGH, TIS_CAP = 0.2, 0.28, 2.0


def reference_token(lp, blp, adv, ref, kl_coef):
    """One token: (loss value, d loss / d logp, clip active, truncated, ratio, k3)."""
    ratio = math.exp(min(20.0, max(-20.0, lp - blp)))
    unclipped, unclipped_grad = -adv * min(ratio, TIS_CAP), -adv * min(ratio, TIS_CAP)
    inside = 1 - CLIP_LOW < ratio < 1 + CLIP_HIGH
    clipped = -adv * min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
    clipped_grad = -adv * ratio if inside else 0.0
    if unclipped > clipped:
        value, grad = unclipped, unclipped_grad
    elif clipped > unclipped:
        value, grad = clipped, clipped_grad
    else:  # a tie: torch.maximum splits the gradient between the two branches
        value, grad = unclipped, (unclipped_grad + clipped_grad) / 2
    k3, k3_grad = 0.0, 0.0
    if ref is not None:
        delta = ref - lp
        k3, k3_grad = math.exp(delta) - delta - 1, 1 - math.exp(delta)
    return value + kl_coef * k3, grad + kl_coef * k3_grad, clipped > unclipped, ratio > TIS_CAP, ratio, k3


def reference_weights(masks, keys, loss_agg):
    """Per token: 1/(tokens in the step), or 1/(trajectories)/(the trajectory's tokens)."""
    total = sum(sum(m) for m in masks)
    per_key: dict[str, float] = {}
    for m, k in zip(masks, keys, strict=True):
        per_key[k] = per_key.get(k, 0) + sum(m)
    trajectories = len([k for k, n in per_key.items() if n])
    out = []
    for m, k in zip(masks, keys, strict=True):
        if loss_agg == "token":
            out.append([x / total for x in m])
        else:
            out.append([x / (per_key[k] * trajectories) for x in m])
    return out


def random_step(seed):
    """Samples of random lengths (some trajectories split in two), far-off behaviour logprobs."""
    rng = random.Random(seed)
    b = rng.randint(2, 6)
    lengths = [rng.randint(3, 12) for _ in range(b)]
    keys = [f"k{rng.randint(0, b - 2)}" for _ in range(b)]
    adv_of = {k: rng.uniform(-2, 2) for k in keys}
    masks = [[float(rng.random() > 0.3) for _ in range(n)] for n in lengths]
    masks[0][0] = 1.0  # at least one trained token
    logp = [[-rng.uniform(0.01, 4) for _ in range(n)] for n in lengths]
    behaviour = [[lp + rng.uniform(-2.5, 2.5) for lp in row] for row in logp]
    ref = [[lp + rng.uniform(-1, 1) for lp in row] for row in logp]
    return lengths, keys, [adv_of[k] for k in keys], masks, logp, behaviour, ref


def padded(rows, width):
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows], dtype=torch.float64)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("loss_agg", ["token", "trajectory"])
def test_loss_matches_a_plain_loop(seed, loss_agg):
    lengths, keys, advs, masks, logp, behaviour, ref = random_step(seed)
    kl_coef = [0.0, 0.1][seed % 2]
    samples = [
        Sample(key=k, group_id="g", input_ids=np.zeros(n, np.int32), loss_mask=np.asarray(m, np.float32),
               behaviour_logprobs=np.zeros(n, np.float32), advantage=a)
        for k, n, m, a in zip(keys, lengths, masks, advs, strict=True)
    ]  # fmt: skip
    want_w = reference_weights(masks, keys, loss_agg)
    got_w = token_weights(samples, loss_agg)
    for g, w in zip(got_w, want_w, strict=True):
        assert np.allclose(g, w, rtol=1e-6)

    width = max(lengths)
    x = padded(logp, width).requires_grad_(True)
    adv = padded([[a] * n for a, n in zip(advs, lengths, strict=True)], width)
    out = ppo_tis_loss(
        x, padded(behaviour, width), adv, padded(masks, width), padded(want_w, width),
        clip_low=CLIP_LOW, clip_high=CLIP_HIGH, tis_cap=TIS_CAP, ref_logp=padded(ref, width), kl_coef=kl_coef,
    )  # fmt: skip
    out.loss.backward()

    loss, grads, clipped, truncated, ratios, kls = 0.0, [], 0, 0, [], []
    for i, n in enumerate(lengths):
        row = []
        for t in range(n):
            value, grad, c, tr, r, k3 = reference_token(
                logp[i][t], behaviour[i][t], advs[i], ref[i][t], kl_coef
            )
            w = want_w[i][t]
            loss += w * value
            row.append(w * grad)
            if masks[i][t]:
                clipped, truncated = clipped + c, truncated + tr
                ratios.append(r)
                kls.append(k3)
        grads.append(row)
    n_tokens = len(ratios)
    assert out.tokens == n_tokens
    assert out.loss.item() == pytest.approx(loss, rel=1e-9, abs=1e-12)
    assert torch.allclose(x.grad, padded(grads, width), rtol=1e-9, atol=1e-12)
    assert out.clip_fraction == pytest.approx(clipped / n_tokens)
    assert out.tis_fraction == pytest.approx(truncated / n_tokens)
    assert out.ratio_mean == pytest.approx(sum(ratios) / n_tokens, rel=1e-9)
    assert out.kl == pytest.approx(sum(kls) / n_tokens, rel=1e-9)


def test_the_random_inputs_reach_every_branch_of_the_loss():
    """Across the seeds above, both advantage signs meet ratios below the clip, inside it,
    between the clip and the TIS cap, and past the cap."""
    regions = set()
    for seed in range(12):
        lengths, _, advs, masks, logp, behaviour, _ = random_step(seed)
        for i, n in enumerate(lengths):
            for t in range(n):
                r = math.exp(logp[i][t] - behaviour[i][t])
                where = sum(r > edge for edge in (1 - CLIP_LOW, 1 + CLIP_HIGH, TIS_CAP))
                regions.add((advs[i] > 0, where))
    assert regions == {(sign, where) for sign in (True, False) for where in range(4)}


@pytest.mark.parametrize("seed", range(4))
def test_logprobs_and_entropy_match_a_plain_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 7, (2, 5), generator=gen)
    lp, ent = token_logprobs(logits, targets), token_entropy(logits)
    for b in range(2):
        for t in range(5):
            row = logits[b, t].tolist()
            top = max(row)
            z = sum(math.exp(v - top) for v in row)
            logs = [v - top - math.log(z) for v in row]
            assert lp[b, t].item() == pytest.approx(logs[int(targets[b, t])], rel=1e-5)
            assert ent[b, t].item() == pytest.approx(-sum(math.exp(v) * v for v in logs), rel=1e-5)


def test_chunked_logprobs_and_entropy_equal_the_whole_vocabulary_computation(monkeypatch):
    """token_logprobs/token_entropy reduce the vocabulary a chunk of positions at a time (memory);
    values and gradients must equal the one-shot log_softmax over (B, T, V)."""
    from squall.trainer import losses

    monkeypatch.setattr(losses, "LOGIT_CHUNK", 7)  # many chunks, the last one ragged
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, 11, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (3, 40), generator=gen)
    weights = torch.randn(3, 40, generator=gen)
    whole = torch.log_softmax(logits, -1)
    expected = torch.gather(whole, -1, targets[..., None]).squeeze(-1)
    (expected * weights).sum().backward()
    expected_grad, logits.grad = logits.grad.clone(), None
    got = losses.token_logprobs(logits, targets)
    (got * weights).sum().backward()
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(logits.grad, expected_grad, atol=1e-6)
    entropy = -(whole.exp() * whole).sum(-1)
    assert torch.allclose(losses.token_entropy(logits), entropy.detach(), atol=1e-6)

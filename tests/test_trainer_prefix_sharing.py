"""Shared-prefix micro-batches (trainer/prefix_sharing.py): the plan, and that running a
group's common prompt once gives the loss and the gradient of running every row whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from squall.shared.config import load_config
from squall.trainer.backend import make_backend
from squall.trainer.prefix_sharing import MIN_PREFIX, Microbatch, plan_microbatches, shareable_prefix
from squall.trainer.sequences import Sample, token_weights

torch.set_num_threads(1)
VOCAB = 128


def make_sample(
    group: str, key: str, prompt: np.ndarray, own: np.ndarray, trained_from: int, adv: float
) -> Sample:
    """prompt + own tokens; the own tokens from `trained_from` on are trained (mask 1)."""
    ids = np.concatenate([prompt, own]).astype(np.int32)
    mask = np.zeros(ids.shape[0], np.float32)
    mask[len(prompt) + trained_from :] = 1
    behaviour = np.where(mask > 0, -np.log(VOCAB), 0).astype(np.float32)
    return Sample(key, group, ids, mask, behaviour, adv)


def group_of(name: str, size: int, prompt_len: int, seed: int) -> list[Sample]:
    """`size` attempts at one prompt of `prompt_len` tokens, each followed by its own trained
    tokens, of different lengths (6, 9, 12, ...)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, VOCAB, prompt_len)
    out = []
    for i in range(size):
        own = rng.integers(3, VOCAB, 6 + 3 * i)
        out.append(make_sample(name, f"{name}:{i}#0", prompt, own, 0, 1.0 if i % 2 else -1.0))
    return out


def test_plan_shares_a_groups_prompt_and_packs_the_rest_as_before():
    a, b = group_of("a", 4, 50, seed=1), group_of("b", 3, 40, seed=2)
    short = group_of("c", 2, MIN_PREFIX - 5, seed=3)  # a prompt too short to be worth a second call
    lone = group_of("d", 1, 60, seed=4)
    samples = a + b + short + lone
    plan = plan_microbatches(samples, 4096, share=True)
    by_first = {samples[mb.indices[0]].group_id: mb for mb in plan}
    # The prefix ends one token before the first trained token: that position's logit is needed.
    assert sorted(by_first["a"].indices) == [0, 1, 2, 3] and by_first["a"].prefix == 49
    assert sorted(by_first["b"].indices) == [4, 5, 6] and by_first["b"].prefix == 39
    unshared = [mb for mb in plan if mb.prefix == 0]
    assert sorted(i for mb in unshared for i in mb.indices) == [7, 8, 9]
    assert sorted(i for mb in plan for i in mb.indices) == list(range(len(samples)))
    # Off: exactly the length packing of before.
    assert all(mb.prefix == 0 for mb in plan_microbatches(samples, 4096, share=False))


def test_plan_keeps_a_micro_batch_inside_the_token_budget():
    group = group_of("a", 8, 60, seed=5)  # own parts 6..27 tokens
    plan = plan_microbatches(group, 60 + 2 * 27, share=True)
    assert len(plan) > 1 and all(mb.prefix == 59 for mb in plan if len(mb.indices) > 1)
    for mb in plan:
        longest_own = max(group[i].length - mb.prefix for i in mb.indices)
        assert mb.prefix + len(mb.indices) * longest_own <= 60 + 2 * 27


def test_prefix_stops_where_samples_differ_or_training_starts():
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, 50)
    x = make_sample("g", "g:0#0", prompt, rng.integers(3, VOCAB, 10), 0, 1.0)
    late = make_sample("g", "g:1#0", prompt, rng.integers(3, VOCAB, 10), 4, 1.0)
    assert shareable_prefix([x, late]) == 49  # x's first trained token is at 50
    other = prompt.copy()
    other[45] = (other[45] + 1) % VOCAB
    y = make_sample("g", "g:2#0", other, rng.integers(3, VOCAB, 10), 0, 1.0)
    assert shareable_prefix([x, y]) == 45
    # Two seats of one group whose prompts differ from the start are not bucketed together.
    seat = make_sample("g", "g:0#0", rng.integers(3, VOCAB, 50), rng.integers(3, VOCAB, 8), 0, 1.0)
    assert all(mb.prefix == 0 for mb in plan_microbatches([x, seat], 4096, share=True))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def backend_for(tmp_path, model_path, **trainer):
    config = load_config(
        overrides={
            "run": {"name": "prefix", "dir": str(tmp_path / "run")},
            "model": {"path": str(model_path)},
            "trainer": {"lr": 1e-2, "device": "cpu", "max_tokens_per_microbatch": 4096, **trainer},
        },
        env={},
    )
    backend = make_backend("torch", config)
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters something to change
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return backend


def gradients_of(backend, samples, plan):
    """Metric sums and the summed gradient of the step's micro-batches, without the update."""
    weights = token_weights(samples, "token")
    backend.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for mb in plan:
        for name, value in backend._microbatch(samples, weights, mb).items():
            sums[name] = sums.get(name, 0.0) + value
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    return sums, grads


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_a_shared_prefix_gives_the_loss_and_gradient_of_whole_rows(tmp_path, tiny_llama, lora_rank):
    samples = group_of("a", 4, 50, seed=7) + group_of("b", 3, 40, seed=8)
    backend = backend_for(tmp_path, tiny_llama, lora_rank=lora_rank, kl_coef=0.1)
    shared_plan = plan_microbatches(samples, 4096, share=True)
    assert sorted(mb.prefix for mb in shared_plan) == [39, 49]
    whole = gradients_of(backend, samples, [Microbatch(list(range(len(samples))))])
    shared = gradients_of(backend, samples, shared_plan)
    for name in ("loss", "pg_loss", "kl", "entropy", "gap", "tokens", "ratio"):
        assert shared[0][name] == pytest.approx(whole[0][name], rel=1e-4, abs=1e-6), name
    assert whole[1].keys() == shared[1].keys() and whole[1]
    for name, grad in whole[1].items():
        torch.testing.assert_close(shared[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_train_step_shares_by_default_and_matches_the_unshared_step(tmp_path, tiny_llama):
    samples = group_of("a", 4, 50, seed=9)
    on = backend_for(tmp_path / "on", tiny_llama, lora_rank=4)
    off = backend_for(tmp_path / "off", tiny_llama, lora_rank=4, share_prefix=False)
    assert on.share_prefix and not off.share_prefix
    m_on, m_off = on.train_step(samples), off.train_step(samples)
    assert m_on["microbatches"] == 1
    for name in ("loss", "entropy", "grad_norm", "tokens"):
        assert m_on[name] == pytest.approx(m_off[name], rel=1e-4), name
    assert on.loss_on(samples) == pytest.approx(off.loss_on(samples), rel=1e-3)
    # Gradient checkpointing drops the cache the second call reads: sharing is off there.
    assert not backend_for(tmp_path / "gc", tiny_llama, gradient_checkpointing=True).share_prefix

"""shared/transformers_compat.py on the installed transformers: the KV cache really reaches the
model under the keyword it picks (a keyword the model swallowed into **kwargs and ignored would
decode from nothing and give different logits), through a peft wrapper too, and activation
checkpointing switches on by the current name. pyproject's filterwarnings makes the deprecated
spellings errors in every in-process test, so a call site that bypasses this module fails."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from squall.inference.tiny import build_tiny_model
from squall.shared.transformers_compat import (
    cache_arg,
    cache_keyword,
    checkpointing_argument,
    enable_activation_checkpointing,
    returned_cache,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def _cached_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The last position's logits of `ids`, decoded one token at a time after a prefill of `prompt`."""
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    for t in range(prompt, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], use_cache=True, **cache_arg(model, returned_cache(out)))
    return out.logits[:, -1]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "peft"])
def test_a_cached_decode_gives_a_full_forwards_logits(folder, wrapped):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if wrapped:
        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft's own use of an old name
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(10, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=ids).logits[:, -1]
        got = _cached_logits(model, ids, prompt=7)
        blind = model(input_ids=ids[:, -1:]).logits[:, -1]  # what a dropped cache would give
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(blind, expected, atol=1e-3)
    forward = (model.get_base_model() if wrapped else model).forward
    assert cache_keyword(model) in inspect.signature(forward).parameters


def test_activation_checkpointing_switches_on(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    enable_activation_checkpointing(model)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    model.train()
    ids = torch.randint(10, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("on", [False, True])
def test_training_arguments_take_checkpointing_by_the_current_name(tmp_path, on):
    from transformers import TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, **checkpointing_argument(TrainingArguments, on)
    )
    assert getattr(arguments, "activation_checkpointing", arguments.gradient_checkpointing) is on
    assert arguments.gradient_checkpointing is on

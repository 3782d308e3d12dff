"""The torch engine's shared prefill (torch_engine.py): prompts admitted together compute their
common opening once, identical prompts share one row, and the next admission reuses the kept
opening. Whatever is shared, each request must get exactly the tokens and logprobs a plain
one-prompt greedy decode of the same model gives."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from squall.inference.engines.engine import SamplingParams
from squall.inference.engines.torch_engine import TorchEngine
from squall.inference.tiny import build_tiny_model
from squall.shared.config import InferenceSection

torch.set_num_threads(1)

STEPS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one prompt, no cache at all."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.inference_mode():
        for _ in range(STEPS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return tokens, logprobs


async def served(engine: TorchEngine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        logprobs: list[float] = []
        async for delta in engine.generate(prompt, params, stream=False):
            tokens += delta.token_ids
            logprobs += delta.logprobs
        return tokens, logprobs

    return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 120)


def test_shared_openings_decode_like_separate_prompts(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    opening = list(range(5, 45))  # 40 tokens every prompt starts with (a system prompt, say)
    group = opening + [50, 51, 52]
    first = [group, group, group, opening + [60, 61, 62, 63, 64, 65], opening + [70]]
    later = [opening + [80, 81], opening[:30] + [90, 91, 92]]  # reuse all / part of the kept one

    async def run() -> tuple[list, list, dict]:
        engine = TorchEngine(model_dir, InferenceSection(max_batch=16))
        await engine.start()
        try:
            return await served(engine, first), await served(engine, later), engine.stats()
        finally:
            await engine.stop()

    got_first, got_later, stats = asyncio.run(run())
    for prompt, (tokens, logprobs) in zip(first + later, got_first + got_later, strict=True):
        want_tokens, want_logprobs = reference(model, prompt)
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    prompt_tokens = sum(len(p) for p in first + later)
    assert stats["prefill_requests"] == len(first) + len(later)
    assert stats["prefill_rows"] < stats["prefill_requests"]  # the three identical prompts shared a row
    # The 40-token opening was computed about once, not seven times.
    assert stats["prefill_tokens"] < prompt_tokens - 4 * len(opening)

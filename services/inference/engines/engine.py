"""The backend interface every inference engine implements, and the factory that picks one.

An engine turns prompt token ids into sampled token ids. It owns the model and its weights;
the HTTP layer (server.py) owns requests, chat templates and response formats.

Contract (both backends):
- `generate(prompt_ids, params, stream=...)` yields `Delta`s. Every `Delta` of one request
  carries the same `weight_version`: an engine never changes weights under a running request.
  With `stream=False` an engine may send one final `Delta` per choice instead of one per token.
- `token_ids` are the tokens actually sampled, including a final eos token when one was
  sampled; `logprobs[i]` is the log-probability of `token_ids[i]` under the model's own
  distribution at temperature 1 (raw logits: no temperature, no top_p).
- `text` deltas concatenate to the decoding of the response tokens without the final eos
  token (special tokens kept, so `<tool_call>` survives), cut before the first stop string.
- `apply_weights(version, path)` loads a safetensors state dict and starts serving it between
  requests; it raises WeightsError (old weights kept) when the file cannot be loaded.
  `apply_adapter(version, folder)` does the same for a LoRA adapter on the base model.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from squall.shared.config import InferenceSection

BACKENDS = ("torch", "vllm")


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings of one request (the server checks the bounds)."""

    max_tokens: int  # most tokens to sample per choice
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    n: int = 1  # choices sampled from the same prompt
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    seed: int | None = None  # choice i samples from a generator seeded with seed + i
    ignore_eos: bool = False  # keep sampling past eos (benchmarks)


@dataclass
class Delta:
    """New output of one choice. Lists line up: `logprobs[i]` belongs to `token_ids[i]`."""

    index: int  # choice index within the request, 0..n-1
    token_ids: list[int] = field(default_factory=list)  # newly sampled token ids
    logprobs: list[float] = field(default_factory=list)  # their temperature-1 logprobs
    text: str = ""  # newly decoded text
    finish_reason: str | None = None  # "stop" (eos or stop string) | "length" | None: running
    weight_version: int = 0  # weights that sampled every token of this request


class Engine(abc.ABC):
    """One model replica that samples tokens for many concurrent requests."""

    backend: str = ""
    tokenizer: Any  # a transformers tokenizer with the model's chat template
    max_model_len: int  # prompt plus completion tokens
    max_batch: int  # most sequences sampled at once; a request's n may not exceed it

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version new requests are served with."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and begin serving."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop serving; in-flight requests end."""

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, stream: bool
    ) -> AsyncIterator[Delta]:
        """Sample `params.n` choices for `prompt_ids`; see the module docstring."""

    @abc.abstractmethod
    async def apply_weights(self, version: int, path: str) -> None:
        """Serve the safetensors state dict at `path` as `version`, between requests."""

    @abc.abstractmethod
    async def apply_adapter(self, version: int, folder: str) -> None:
        """Serve the base model (the one the engine started with) with the LoRA adapter in
        `folder` (peft layout, shared.adapterfiles) as `version`; the previous adapter is
        replaced, not stacked. Same rules as apply_weights: never under a running request,
        WeightsError (old version kept) when the adapter cannot be applied."""

    def stats(self) -> dict[str, int]:
        """For /metrics: `running` sequences, `waiting` requests, and running totals of
        `forward_passes` and `sampled_tokens` (their ratio is the mean batch size)."""
        return {"running": 0, "waiting": 0, "forward_passes": 0, "sampled_tokens": 0}


def make_engine(section: InferenceSection, model_dir: str, *, lora_rank: int = 0) -> Engine:
    """The engine named by `section.backend`. `lora_rank` > 0: the weights will arrive as
    adapters of that rank (vLLM must be started for them; torch merges whatever comes)."""
    backend = section.backend
    if backend == "torch":
        from squall.inference.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, section)
    if backend == "vllm":
        from squall.inference.engines.vllm_engine import VllmEngine

        return VllmEngine(model_dir, section, lora_rank=lora_rank)
    raise ValueError(f"unknown inference backend {backend!r}; known backends: {', '.join(BACKENDS)}")

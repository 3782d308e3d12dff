"""The torch backend: a transformers causal LM with continuous batching on CPU or GPU.

One engine thread owns the model and runs the scheduling loop; request coroutines talk to
it through a thread-safe inbox and per-request asyncio queues. Each loop iteration is one
model forward:
- admit waiting requests while the batch has room: prefill their prompts together (left
  padding, attention mask, position ids from the mask), sample each choice's first token,
  and merge their KV cache into the running batch's cache (left-padded to one length).
  Identical prompts share a row, and the prompts' common opening is computed once (or taken
  from the one kept since the last admission) and continued by every row;
- otherwise decode one token for every running sequence, all rows in one forward;
- drop finished or cancelled rows from the cache, and leading columns no row attends to.

Weight versions: a request is pinned to the version current when it was admitted. A new
version is loaded into a copy of the model off the engine thread (a sharded version shard by
shard, shardload.py); once it is ready the loop swaps it in between two forwards
(`inference.swap`):
- "overlap" (default): the running batch becomes the *draining* batch, which keeps decoding
  on the old model until its last row finishes, while new requests are admitted at once into a
  fresh batch on the new model (one forward of each per loop iteration). A new request waits
  for no running one; memory holds both models until the drain ends; a version that arrives
  during a drain is swapped in when it ends (requests go on being admitted meanwhile);
- "drain": stop admitting, let running sequences finish, swap, admit again (new requests wait
  for the longest running generation: seconds to tens of seconds on a CPU-served 135M model).
Either way no response mixes two versions.

Roles (several LoRA adapters at once): while the node serves only the `policy` role's newest
version, that adapter is merged into a copy of the base (adapters.py: a merged forward is a
plain forward, nothing extra per token). The first adapter of another role, or the first
request for an older `policy@version`, switches the engine (once, with a drain) to the mixed
model: the pristine base with an AdapterBank (weights/multilora.py) hooked into its linear
layers, each running row carrying the slot of its own (role, version), so requests for
different roles, versions and the base share every forward. New adapters then go into free
slots without a drain; a slot no row uses and no role serves as its newest is reused.

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
from squall.inference.weights.catalog import AdapterCatalog, ModelUnavailable
from squall.inference.weights.multilora import BASE_SLOT, AdapterBank, load_adapter
from squall.inference.weights.shardload import iter_shards
from squall.shared.adapterfiles import FORMAT_LORA, verify_adapter
from squall.shared.config import InferenceSection
from squall.shared.errors import WeightsError
from squall.shared.roles import DEFAULT_ROLE
from squall.shared.transformers_compat import cache_arg, returned_cache
from squall.shared.weightfiles import read_index

log = structlog.get_logger()

SWAP_DEADLINE_S = 600.0  # longest wait for running requests to finish before a version is given up
IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps on its inbox before looking again
ADMIT_FRACTION = 4  # admit newcomers at once when they are >= 1/4 of the running batch...
ADMIT_AFTER_STEPS = 4  # ...or after they waited this many decode steps
ADAPTER_SLOTS = 16  # adapters the mixed model holds at once (slot 0, the base, not counted)
MIN_SHARED_PREFIX = 16  # shorter common openings are recomputed with each row (not worth a forward)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _common_prefix(prompts: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest opening all `prompts` share."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        n = next((i for i in range(n) if prompt[i] != first[i]), n)
    return first[:n]


class _Request:
    """One HTTP request's prompt, settings and the queue its deltas go to."""

    def __init__(
        self, prompt_ids: list[int], params: SamplingParams, stream: bool, role: str, wanted: int | None
    ) -> None:
        self.prompt_ids, self.params, self.stream = prompt_ids, params, stream
        self.role, self.wanted = role, wanted  # the role and version asked for (None: newest)
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[list[Delta] | BaseException] = asyncio.Queue()
        self.cancelled = False  # set by the client side when it goes away
        self.version = 0  # the role's weight version, fixed at admission
        self.slot = BASE_SLOT  # its adapter slot in the mixed model (BASE_SLOT: none)

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


BATCH_STATE = ("model", "_seqs", "_cache", "_mask", "_pos", "_last", "_temps", "_top_p", "_slots")


class _Draining:
    """A running batch and the model it was admitted on, set aside at a swap (swap=overlap):
    the engine decodes it with that model until its last row finishes."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    @classmethod
    def of(cls, engine: Any) -> _Draining:
        return cls({name: getattr(engine, name) for name in BATCH_STATE})

    @property
    def seqs(self) -> list[_Sequence]:
        return self.state["_seqs"]

    def restore(self, engine: Any) -> None:
        for name, value in self.state.items():
            setattr(engine, name, value)


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
        self._pending: tuple[int, Any, concurrent.futures.Future, tuple | None] | None = None  # next weights
        self._swap_lock = threading.Lock()  # the swap and giving up on it exclude each other
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._waited = 0  # decode steps the waiting requests have been held back
        self._policy_folder = ""  # the policy's newest adapter, while it is merged
        self._draining: _Draining | None = None  # the old version's batch, finishing (swap=overlap)
        self._forwards = 0  # model forwards (prefill or decode) since start
        self._sampled = 0  # tokens sampled since start; _sampled / _forwards is the mean batch
        self.catalog = AdapterCatalog()
        self._bank: AdapterBank | None = None  # the mixed model's adapters (None: merged mode)
        self._slot_of: dict[tuple[str, int], int] = {}  # (role, version) -> bank slot
        self._bank_jobs: queue.Queue[tuple] = queue.Queue()  # adapters read, for the engine thread to place
        self._mixing = asyncio.Lock()  # one switch to the mixed model
        self._prefill_rows = 0  # distinct prompts prefilled since start...
        self._prefill_requests = 0  # ...for this many requests (identical prompts share a row)
        self._prefill_tokens = 0  # prompt tokens actually run through the model
        self.share_prefill = True  # False: every request prefills its whole prompt (benchmarks)
        # The last shared prompt opening and its one-row KV per layer; weights-specific, so a
        # swap empties it.
        self._prefix: tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = ((), [])
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
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool,
        role: str = DEFAULT_ROLE,
        version: int | None = None,
    ) -> AsyncIterator[Delta]:
        request = _Request(list(prompt_ids), params, stream, role, version)
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

    async def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        # One forward outside the engine's loop, on the model served now: a weight swap
        # replaces self.model by a new object, so this reference stays whole while it runs.
        model = self.model

        def score() -> list[float | None]:
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids], device=self.device)
                logits = model(input_ids=ids).logits[0, :-1].float()  # (T-1, V): t predicts t+1
                picked = logits.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
                return [None, *(picked - torch.logsumexp(logits, -1)).tolist()]

        return await asyncio.to_thread(score)

    async def apply_weights(self, version: int, path: str) -> None:
        if self._bank is not None:
            raise WeightsError(
                f"format: version {version} is full weights, but this node serves several roles' "
                "adapters on its base model; publish every role as LoRA (trainer.lora_rank > 0)"
            )
        model = await asyncio.to_thread(self._load_copy, path)
        await self._serve(version, model)
        self._base = None  # the model started with is no longer a base an adapter may apply to
        self.catalog.serve(DEFAULT_ROLE, version)

    async def apply_adapter(self, version: int, folder: str, role: str = DEFAULT_ROLE) -> None:
        """Serve the model this node started with (the trainer's base) with the LoRA adapter
        in `folder` as `role`'s newest version: merged in (adapters.py) while only `policy` is
        served, else placed in the mixed model's bank; the base stays pristine either way."""
        from squall.inference.weights.adapters import merged_copy

        if self._base is None:
            raise WeightsError(
                f"format: version {version} is a LoRA adapter, but this node already serves full "
                "weights in place of its base model; restart the node on the run's model.path"
            )
        if self._bank is None and role == DEFAULT_ROLE:
            model = await asyncio.to_thread(merged_copy, self._base, folder)
            await self._serve(version, model)
            self._policy_folder = folder
            self.catalog.serve(role, version)
            return
        await self._go_mixed()
        await self._bank_put(role, version, folder)
        if role == DEFAULT_ROLE:
            self._version = version
        self.catalog.serve(role, version)

    async def prepare(self, role: str, version: int | None) -> None:
        """Make `role`'s `version` servable: the base beside adapters, or an older version read
        back from its folder, needs the mixed model (ModelUnavailable when it cannot be had)."""
        if version is None:  # the newest: the model itself for the policy, never evicted for a role
            newest = self.catalog.newest.get(role, 0)
            if role == DEFAULT_ROLE or newest or self._bank is not None or self._version == 0:
                return
        wanted = 0 if version is None else version  # a role with nothing served yet is the base
        if role == DEFAULT_ROLE and wanted == self._version or (role, wanted) in self._slot_of:
            return  # what the model serves now (merged or mixed), or already in the bank
        if wanted == 0 and self._version == 0 and self._bank is None:
            return  # the model is still the plain base
        found = self.catalog.lookup(role, wanted)
        if wanted and (found is None or found.format != FORMAT_LORA):
            what = "not a LoRA adapter" if found is not None else "not announced to this node"
            raise ModelUnavailable(
                404,
                f"model {role}@{wanted}: version {wanted} of role {role!r} is {what}; versions "
                f"available: {self.catalog.on_disk(role)}",
            )
        try:
            await self._go_mixed()
            if found is not None and wanted:
                await asyncio.to_thread(verify_adapter, found.folder, found.checksum)
                await self._bank_put(role, wanted, found.folder)
        except WeightsError as exc:
            raise ModelUnavailable(
                404,
                f"model {role}@{wanted}: version {wanted} of role {role!r} cannot be served ({exc}); "
                f"versions available: {self.catalog.on_disk(role)}",
            ) from None

    async def _go_mixed(self) -> None:
        """Switch (once, draining running requests) from the merged policy to the pristine base
        with an adapter bank holding the policy's current adapter."""
        async with self._mixing:
            if self._bank is not None:
                return
            base = self._base
            if base is None:
                raise WeightsError(
                    "format: this node serves full weights in place of its base model, so it cannot "
                    "serve the base or other roles' adapters beside them"
                )
            shared = {id(t): t for t in [*base.parameters(), *base.buffers()]}
            mixed = copy.deepcopy(base, memo=shared).eval()  # own modules (for the hooks), shared tensors
            bank = AdapterBank(mixed, slots=ADAPTER_SLOTS + 1)
            slot_of = {}
            if self._version and self._policy_folder:
                adapter = await asyncio.to_thread(
                    load_adapter, base, self._policy_folder, self.dtype, self.device
                )
                slot_of[(DEFAULT_ROLE, self._version)] = bank.put(adapter)
            await self._serve(self._version, mixed, bank=(bank, slot_of))
            log.info("mixed_adapters_on", slots=ADAPTER_SLOTS, policy_version=self._version)

    async def _bank_put(self, role: str, version: int, folder: str) -> None:
        """Read the adapter here; the engine thread places it between two forwards."""
        assert self._base is not None
        adapter = await asyncio.to_thread(load_adapter, self._base, folder, self.dtype, self.device)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._bank_jobs.put((role, version, adapter, done))
        await asyncio.wait_for(asyncio.wrap_future(done), SWAP_DEADLINE_S)

    def _run_bank_jobs(self) -> None:
        """Engine thread: place the adapters read since the last step, freeing a slot no running
        row uses and no role serves as its newest when the bank is full."""
        while True:
            try:
                role, version, adapter, done = self._bank_jobs.get_nowait()
            except queue.Empty:
                return
            try:
                assert self._bank is not None
                if (role, version) not in self._slot_of:
                    if self._bank.free_slot() is None:
                        self._evict()
                    self._slot_of[(role, version)] = self._bank.put(adapter)
                done.set_result(None)
            except Exception as exc:  # the waiting apply/prepare reports it
                done.set_exception(exc)

    def _evict(self) -> None:
        assert self._bank is not None
        used = {seq.request.slot for seq in self._seqs}
        newest = set(self.catalog.newest.items())
        for key, slot in list(self._slot_of.items()):
            if slot not in used and key not in newest:
                del self._slot_of[key]
                self._bank.drop(slot)
                return
        raise WeightsError(f"load: all {ADAPTER_SLOTS} adapter slots are serving requests; try again shortly")

    async def _serve(self, version: int, model: Any, *, bank: tuple | None = None) -> None:
        """Hand `model` (and the mixed model's bank) to the engine thread and wait until it
        serves it as `version`."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        pending = (version, model, done, bank)
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
            "running": len(self._seqs) + (len(self._draining.seqs) if self._draining else 0),
            "waiting": len(self._waiting) + self._inbox.qsize(),
            "forward_passes": self._forwards,
            "sampled_tokens": self._sampled,
            "prefill_rows": self._prefill_rows,
            "prefill_requests": self._prefill_requests,
            "prefill_tokens": self._prefill_tokens,
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
        self._slots = torch.zeros(0, dtype=torch.long)  # (B,) each row's adapter slot

    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                try:
                    self._step()
                except Exception as exc:  # a failed forward must not stop the node
                    log.exception("engine_step_failed", running=len(self._seqs))
                    for request in {seq.request for seq in self._seqs + self._draining_seqs()}:
                        request.send(RuntimeError(f"generation failed: {exc}"))
                    self._reset_batch()
                    self._draining = None
        for request in {seq.request for seq in self._seqs + self._draining_seqs()} | set(self._waiting):
            request.send(RuntimeError("the inference engine stopped"))
        if self._pending is not None:  # nobody may wait forever for a swap that cannot happen
            self._pending[2].set_exception(
                WeightsError("load: the engine stopped before the new weights were served")
            )

    def _step(self) -> None:
        self._drop(lambda seq: seq.request.cancelled)
        self._run_bank_jobs()
        if self._draining is not None:
            self._drain_once()
        if self._pending is not None and self._draining is None:
            if not self._seqs:
                self._swap()
            elif self.section.swap == "overlap" and self._bank is None and self._pending[3] is None:
                # Overlap only between plain (merged) models: a switch to the mixed model, or a
                # version while adapters are banked, waits for the running rows (their slots).
                self._draining = _Draining.of(self)  # the running rows finish on the old model
                self._reset_batch()
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
            version, model, done, bank = self._pending
            self.model, self._version, self._pending = model, version, None
            if bank is not None:
                self._bank, self._slot_of = bank
            self._prefix = ((), [])  # computed with the old weights
            done.set_result(None)

    def _drain_once(self) -> None:
        """One decode step of the draining batch on its own (old) model; it ends with its last row."""
        assert self._draining is not None
        current = _Draining.of(self)
        self._draining.restore(self)
        try:
            self._drop(lambda seq: seq.request.cancelled)
            if self._seqs:
                self._decode()
        finally:
            self._draining = _Draining.of(self) if self._seqs else None
            current.restore(self)

    def _draining_seqs(self) -> list[_Sequence]:
        return self._draining.seqs if self._draining is not None else []

    def _admit(self) -> list[_Request]:
        block = not self._seqs and not self._waiting and self._draining is None
        try:
            while True:
                self._waiting.append(
                    self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
                )
                block = False
        except queue.Empty:
            pass
        admitted: list[_Request] = []
        if (self._pending is not None and self.section.swap == "drain") or not self._waiting:
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
            try:
                self._pin(request)
            except ModelUnavailable as exc:
                request.send(exc)
                continue
            admitted.append(request)
            room -= request.params.n
        return admitted

    def _pin(self, request: _Request) -> None:
        """Fix the request's version (its role's newest unless it named one) and its slot."""
        role = request.role
        version = self.catalog.newest.get(role, 0) if request.wanted is None else request.wanted
        request.version = self._version if role == DEFAULT_ROLE and request.wanted is None else version
        if self._bank is None:  # merged: the policy's current version, or the base while it is one
            if not (
                role == DEFAULT_ROLE
                and request.version == self._version
                or request.version == self._version == 0
            ):
                raise ModelUnavailable(
                    503, f"model {role}@{request.version} is not loaded on this node yet; retry"
                )
            return
        if request.version == 0:
            request.slot = BASE_SLOT
            return
        slot = self._slot_of.get((role, request.version))
        if slot is None:
            raise ModelUnavailable(
                503, f"model {role}@{request.version}: its adapter was unloaded to make room; retry"
            )
        request.slot = slot

    def _rows(self, slots: torch.Tensor) -> None:
        """Tell the bank which adapter each row of the next forward uses."""
        if self._bank is not None:
            self._bank.rows = slots if bool(slots.any()) else None

    def _prefill(self, requests: list[_Request]) -> None:
        # Identical prompts on the same adapter share one prefill row: a GRPO group's attempts
        # open with the same prompt and usually arrive together, so their first turns cost one
        # prompt forward.
        keyed = [(r.slot, tuple(r.prompt_ids)) for r in requests]
        unique = keyed if not self.share_prefill else list(dict.fromkeys(keyed))
        self._prefill_rows_of(requests, unique)

    def _prefill_rows_of(self, requests: list[_Request], unique: list[tuple[int, tuple[int, ...]]]) -> None:
        # With sharing off, equal prompts map to the last of their (equal) rows.
        row_of = {key: row for row, key in enumerate(unique)}
        prompts = [prompt for _, prompt in unique]
        self._prefill_rows += len(unique)
        self._prefill_requests += len(requests)
        # The prompts' common opening (system prompt, tools, earlier turns) is computed once, or
        # taken from the last admission's (`_prefix`), and every row computes only its own rest.
        # Only while one model serves every row (merged mode): with the adapter bank each row's
        # keys and values depend on its own adapter.
        sharing = self.share_prefill and self._bank is None
        prefix = _common_prefix(prompts)[: min(len(p) for p in prompts) - 1] if sharing else ()
        cache = self._prefix_cache(prefix) if len(prefix) >= MIN_SHARED_PREFIX else None
        if cache is None:
            prefix = ()
            cache = roomy_cache(self.model.config)
        else:
            cache.batch_select_indices(torch.zeros(len(unique), dtype=torch.long, device=self.device))
        shared = len(prefix)
        length = max(len(p) for p in prompts) - shared
        ids = torch.full((len(unique), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(unique), shared + length), dtype=torch.long)
        mask[:, :shared] = 1
        for row, prompt in enumerate(prompts):
            rest = prompt[shared:]
            ids[row, length - len(rest) :] = torch.tensor(rest)
            mask[row, shared + length - len(rest) :] = 1
        self._prefill_tokens += int(mask[:, shared:].sum())
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)[:, shared:]
        self._rows(torch.tensor([slot for slot, _ in unique], device=self.device))
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **cache_arg(self.model, cache),
        )
        # n choices share one prefill: repeat each prompt's row n times.
        rows = torch.tensor(
            [row_of[(r.slot, tuple(r.prompt_ids))] for r in requests for _ in range(r.params.n)]
        )
        cache = returned_cache(out)
        cache.batch_select_indices(rows.to(self.device))
        seqs = [_Sequence(r, i, self._decode_text) for r in requests for i in range(r.params.n)]
        logits = out.logits[:, -1].index_select(0, rows.to(self.device))  # (B_new, V)
        temps = torch.tensor([s.request.params.temperature for s in seqs], device=self.device)
        top_p = torch.tensor([s.request.params.top_p for s in seqs], device=self.device)
        tokens, logprobs = self._sample(logits, temps, top_p, seqs)
        slots = torch.tensor([s.request.slot for s in seqs], device=self.device)
        fresh = self._cache is None or not self._seqs
        self._merge(seqs, cache, mask[rows].to(self.device), mask.sum(-1)[rows].to(self.device), temps, top_p)
        self._slots = slots if fresh else torch.cat([self._slots, slots])
        self._last = torch.cat([self._last, tokens])
        self._finish_step(seqs, tokens.tolist(), logprobs.tolist())

    def _prefix_cache(self, prefix: tuple[int, ...]) -> Any:
        """A one-row KV cache holding `prefix`: the kept prefix's columns it shares, plus a
        forward over the rest; the result is kept for the next admission."""
        kept, kept_kv = self._prefix
        reused = len(_common_prefix([kept, prefix]))
        cache = roomy_cache(self.model.config)
        if reused:
            for layer, (keys, values) in enumerate(kept_kv):
                cache.update(keys[:, :, :reused].clone(), values[:, :, :reused].clone(), layer)
        if reused < len(prefix):
            self.model(
                input_ids=torch.tensor([prefix[reused:]], device=self.device),
                position_ids=torch.arange(reused, len(prefix), device=self.device)[None],
                use_cache=True,
                logits_to_keep=1,
                **cache_arg(self.model, cache),
            )
        self._prefix = (prefix, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])
        self._prefill_tokens += len(prefix) - reused
        return cache

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
        self._rows(self._slots)
        out = self.model(
            input_ids=self._last[:, None],
            attention_mask=self._mask,
            position_ids=self._pos[:, None],
            use_cache=True,
            **cache_arg(self.model, self._cache),
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
        self._slots = self._slots[index]
        attended = self._mask.any(dim=0).nonzero()
        first = int(attended[0]) if len(attended) else 0
        if first:  # columns that were padding for every remaining row
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

"""Native torch backend: CPU or GPUs (bf16 autocast there), AdamW, micro-batches by token
budget accumulated into one step, gradient clipping.

One process trains the model as it is. With more ranks (distributed.py) the model is
sharded with FSDP2, every rank runs its share of the step's micro-batches, and the token
weights still divide by the whole step's tokens, so the summed gradient, the update and the
metrics are those of one process; checkpoints become sharded (torch.distributed.checkpoint).

With `trainer.lora_rank` the model is wrapped by peft first (lora.py): only the adapters train,
are checkpointed and published, and the KL reference is the base with the adapters disabled."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from squall.shared.config import RunConfig, TrainerSection
from squall.shared.transformers_compat import cache_arg, enable_activation_checkpointing, returned_cache

from . import distributed, lora
from .backend import TrainerBackend
from .losses import ppo_tis_loss, token_entropy, token_logprobs
from .prefix_sharing import Microbatch, plan_microbatches
from .sequences import Sample, collate, token_weights

resolve_device = distributed.resolve_device  # where it lived before (imported from here)


def shares_prefix(cfg: TrainerSection, world: distributed.World) -> bool:
    """Whether shared prompts run once (prefix_sharing.py). Not under FSDP: a rank whose
    micro-batch shares would call the model twice while another calls it once, and the
    per-call collectives would pair up wrong. Not with gradient checkpointing, which turns off
    the key/value cache the second call reads."""
    return cfg.share_prefix and not world.distributed and not cfg.gradient_checkpointing


class TorchBackend(TrainerBackend):
    def __init__(self, config: RunConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = config.trainer
        self.world = distributed.current_world()
        self.device = distributed.rank_device(self.cfg.device, self.world)
        torch.manual_seed(config.run.seed)
        if not config.model.path:
            raise ValueError("model.path is empty: set it to the initial policy's transformers folder")
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(
            self.device
        )
        self.model.train()
        self.model.config.use_cache = False
        if self.cfg.gradient_checkpointing:  # before LoRA wraps it: peft keeps the setting
            enable_activation_checkpointing(self.model)
        self.autocast = self.device.type == "cuda"
        self.vocab_size = int(self.model.config.vocab_size)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        if self.cfg.lora_rank:  # only the adapters train (lora.py)
            self.model = lora.wrap(self.model, self.cfg, config.model.path)
        self.reference: Any = None
        if self.cfg.kl_coef > 0 and not self.cfg.lora_rank:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.world.distributed:  # before the optimizer: it must hold the sharded parameters
            distributed.shard_model(self.model)
            if self.reference is not None:
                distributed.shard_model(self.reference)
        if self.cfg.kl_coef > 0 and self.cfg.lora_rank:  # the base: this model, adapters off
            self.reference = lora.AdapterDisabled(self.model)
        self.share_prefix = shares_prefix(self.cfg, self.world)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # all, or the adapters
        self.optimizer = torch.optim.AdamW(trained, lr=self.cfg.lr, betas=(0.9, 0.999), weight_decay=0.0)

    def _forward(self, model: Any, arrays: dict[str, np.ndarray], prefix: int = 0) -> torch.Tensor:
        """Logits (B, T-1-prefix, V): position prefix+t predicts token prefix+t+1. With a
        prefix, its tokens (the same in every row) run once and the rows continue from its
        repeated key/value cache."""
        ids = torch.from_numpy(arrays["input_ids"]).to(self.device)  # (B, T)
        attn = torch.from_numpy(arrays["attention_mask"]).to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if not prefix:
                return model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            cache = returned_cache(model(input_ids=ids[:1, :prefix], use_cache=True))
            cache.batch_repeat_interleave(ids.shape[0])
            positions = torch.arange(prefix, ids.shape[1], device=self.device).expand(ids.shape[0], -1)
            logits = model(
                input_ids=ids[:, prefix:],
                attention_mask=attn,
                position_ids=positions,
                use_cache=True,
                **cache_arg(model, cache),
            ).logits
        return logits[:, :-1]

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        weights = token_weights(samples, self.cfg.loss_agg)  # over the whole step, on every rank
        batches = plan_microbatches(samples, self.cfg.max_tokens_per_microbatch, share=self.share_prefix)
        mine = distributed.share_of(batches, self.world) if self.world.distributed else list(batches)
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict.fromkeys(
            ("loss", "pg_loss", "kl", "clip", "tis", "ratio", "entropy", "gap", "tokens"), 0.0
        )
        for n, batch in enumerate(mine):
            if self.world.distributed:  # reduce-scatter once, after the last micro-batch
                self.model.set_requires_gradient_sync(n == len(mine) - 1)
            for name, value in self._microbatch(samples, weights, batch).items():
                totals[name] += value
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.world.distributed:
            totals = distributed.all_reduce_sums(totals, self.device)
            if hasattr(grad_norm, "full_tensor"):  # a DTensor: the norm over every shard
                grad_norm = grad_norm.full_tensor()
        n_tokens = max(totals["tokens"], 1.0)
        return {
            "loss": totals["loss"],
            "pg_loss": totals["pg_loss"],
            "kl": totals["kl"] / n_tokens,
            "clip_fraction": totals["clip"] / n_tokens,
            "tis_fraction": totals["tis"] / n_tokens,
            "ratio_mean": totals["ratio"] / n_tokens,
            "entropy": totals["entropy"] / n_tokens,
            # Mean |trainer logprob - served logprob| on trained tokens, before this step's update:
            # the inference backend's numerical mismatch (plus staleness where max_staleness > 0).
            "logprob_gap": totals["gap"] / n_tokens,
            "grad_norm": float(grad_norm),
            "tokens": float(totals["tokens"]),
            "microbatches": float(len(batches)),
        }

    def _microbatch(
        self, samples: Sequence[Sample], weights: Sequence[np.ndarray], batch: Microbatch | None
    ) -> dict[str, float]:
        """Forward and backward of one micro-batch; its sums for the step's metrics. None: a
        rank with fewer micro-batches than the others runs one at zero weight (FSDP needs the
        same number of forwards on every rank); it adds no gradient and no metric."""
        filler = batch is None
        if batch is None:
            batch = Microbatch([0])
        chosen, prefix = batch.indices, batch.prefix
        arrays = collate([samples[i] for i in chosen], [weights[i] for i in chosen], self.pad_id)
        if filler:
            arrays["loss_mask"] = np.zeros_like(arrays["loss_mask"])
            arrays["weights"] = np.zeros_like(arrays["weights"])
        t = self._tensors(arrays, prefix)
        logits = self._forward(self.model, arrays, prefix)
        logp = token_logprobs(logits, t["targets"])  # (B, T-1-prefix)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(self._forward(self.reference, arrays, prefix), t["targets"])
        out = self._loss(logp, t, ref_logp)
        out.loss.backward()
        mask = t["loss_mask"] > 0
        entropy = token_entropy(logits.detach())[mask].sum().item() if out.tokens else 0.0
        gap = (logp.detach() - t["behaviour_logprobs"]).abs()[mask].sum().item() if out.tokens else 0.0
        return {
            "loss": float(out.loss.detach()),
            "pg_loss": out.pg_loss,
            "kl": out.kl * out.tokens,
            "clip": out.clip_fraction * out.tokens,
            "tis": out.tis_fraction * out.tokens,
            "ratio": out.ratio_mean * out.tokens,
            "entropy": entropy,
            "gap": gap,
            "tokens": float(out.tokens),
        }

    def _tensors(self, arrays: dict[str, Any], prefix: int = 0) -> dict[str, torch.Tensor]:
        """The collated (B, T-1) arrays the loss reads, from position `prefix` on, on the
        training device (ids and mask stay with the forward, which takes them as numpy)."""
        return {
            k: torch.from_numpy(np.ascontiguousarray(v[:, prefix:])).to(self.device)
            for k, v in arrays.items()
            if k not in ("input_ids", "attention_mask")
        }

    def _loss(self, logp: torch.Tensor, t: dict[str, torch.Tensor], ref_logp: torch.Tensor | None = None):
        """The PPO/TIS loss with this run's clip, TIS cap and (given a reference) KL settings."""
        return ppo_tis_loss(
            logp,
            t["behaviour_logprobs"],
            t["advantages"],
            t["loss_mask"],
            t["weights"],
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            tis_cap=self.cfg.tis_cap,
            ref_logp=ref_logp,
            kl_coef=self.cfg.kl_coef,
            sft_mask=t.get("sft_mask"),
            sft_coef=self.cfg.sft_coef,
        )

    @torch.no_grad()
    def loss_on(self, samples: Sequence[Sample]) -> float:
        """The step loss on `samples` without updating (tests and diagnostics)."""
        weights = token_weights(samples, self.cfg.loss_agg)
        arrays = collate(samples, weights, self.pad_id)
        t = self._tensors(arrays)
        logp = token_logprobs(self._forward(self.model, arrays), t["targets"])
        out = self._loss(logp, t)
        return float(out.loss)

    def weights(self) -> dict[str, Any]:
        """The full state dict on CPU (with LoRA: the adapter's tensors, peft's names); with
        ranks it is gathered to rank 0 (the others get {})."""
        if self.cfg.lora_rank:
            return lora.adapter_weights(self.model, gather=self.world.distributed)
        state = self.model.state_dict()
        if self.world.distributed:
            state = distributed.full_state_dict(self.model)
        # Separate CPU copies: safetensors refuses tensors sharing storage (tied embeddings).
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}

    def adapter_config(self) -> dict[str, Any] | None:
        return lora.adapter_config(self.model) if self.cfg.lora_rank else None

    def _rng_state(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }

    def _restore_rng(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])

    def save_state(self, path: Path) -> None:
        if self.world.distributed:  # a folder of shards, one RNG file per rank
            distributed.save_sharded(path, self.model, self.optimizer, self._rng_state(), self.world)
            return
        model = lora.trainable_state(self.model) if self.cfg.lora_rank else self.model.state_dict()
        torch.save(
            {
                "model": model,
                "optimizer": self.optimizer.state_dict(),
                "rng": self._rng_state(),
                "lora_rank": self.cfg.lora_rank,
            },
            path,
        )

    def load_state(self, path: Path) -> None:
        if self.world.distributed:
            self._restore_rng(distributed.load_sharded(path, self.model, self.optimizer, self.world))
            return
        state = torch.load(path, map_location=self.device, weights_only=False)
        lora.check_checkpoint_rank(state.get("lora_rank", 0), self.cfg.lora_rank, str(path))
        if self.cfg.lora_rank:
            lora.load_trainable_state(self.model, state["model"], str(path))
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._restore_rng(state["rng"])

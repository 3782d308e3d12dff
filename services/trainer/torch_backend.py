"""Native torch backend: one process, CPU or one GPU (bf16 autocast there), AdamW,
micro-batches by token budget accumulated into one step, gradient clipping."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from squall.shared.config import RunConfig

from .backend import TrainerBackend
from .losses import ppo_tis_loss, token_entropy, token_logprobs
from .sequences import Sample, collate, pack_microbatches, token_weights


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TorchBackend(TrainerBackend):
    def __init__(self, config: RunConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = config.trainer
        self.device = resolve_device(self.cfg.device)
        torch.manual_seed(config.run.seed)
        if not config.model.path:
            raise ValueError("model.path is empty: set it to the initial policy's transformers folder")
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(
            self.device
        )
        self.model.train()
        self.model.config.use_cache = False
        self.autocast = self.device.type == "cuda"
        self.vocab_size = int(self.model.config.vocab_size)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.reference = None
        if self.cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, betas=(0.9, 0.999), weight_decay=0.0
        )

    def _forward(self, model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> torch.Tensor:
        ids = torch.from_numpy(arrays["input_ids"]).to(self.device)  # (B, T)
        attn = torch.from_numpy(arrays["attention_mask"]).to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = model(input_ids=ids, attention_mask=attn).logits  # (B, T, V)
        return logits[:, :-1]  # (B, T-1, V): position t predicts token t+1

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        weights = token_weights(samples, self.cfg.loss_agg)
        batches = pack_microbatches([s.length for s in samples], self.cfg.max_tokens_per_microbatch)
        self.optimizer.zero_grad(set_to_none=True)
        totals = {
            "loss": 0.0,
            "pg_loss": 0.0,
            "kl": 0.0,
            "clip": 0.0,
            "tis": 0.0,
            "ratio": 0.0,
            "entropy": 0.0,
        }
        tokens = 0
        for indices in batches:
            arrays = collate([samples[i] for i in indices], [weights[i] for i in indices], self.pad_id)
            t = {
                k: torch.from_numpy(v).to(self.device)
                for k, v in arrays.items()
                if k not in ("input_ids", "attention_mask")
            }
            logits = self._forward(self.model, arrays)
            logp = token_logprobs(logits, t["targets"])  # (B, T-1)
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = token_logprobs(self._forward(self.reference, arrays), t["targets"])
            out = ppo_tis_loss(
                logp, t["behaviour_logprobs"], t["advantages"], t["loss_mask"], t["weights"],
                clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high, tis_cap=self.cfg.tis_cap,
                ref_logp=ref_logp, kl_coef=self.cfg.kl_coef,
            )  # fmt: skip
            out.loss.backward()
            mask = t["loss_mask"] > 0
            entropy = token_entropy(logits.detach())[mask].sum().item() if out.tokens else 0.0
            totals["loss"] += float(out.loss.detach())
            totals["pg_loss"] += out.pg_loss
            totals["kl"] += out.kl * out.tokens
            totals["clip"] += out.clip_fraction * out.tokens
            totals["tis"] += out.tis_fraction * out.tokens
            totals["ratio"] += out.ratio_mean * out.tokens
            totals["entropy"] += entropy
            tokens += out.tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = max(tokens, 1)
        return {
            "loss": totals["loss"],
            "pg_loss": totals["pg_loss"],
            "kl": totals["kl"] / n,
            "clip_fraction": totals["clip"] / n,
            "tis_fraction": totals["tis"] / n,
            "ratio_mean": totals["ratio"] / n,
            "entropy": totals["entropy"] / n,
            "grad_norm": float(grad_norm),
            "tokens": float(tokens),
            "microbatches": float(len(batches)),
        }

    @torch.no_grad()
    def loss_on(self, samples: Sequence[Sample]) -> float:
        """The step loss on `samples` without updating (tests and diagnostics)."""
        weights = token_weights(samples, self.cfg.loss_agg)
        arrays = collate(samples, weights, self.pad_id)
        t = {
            k: torch.from_numpy(v).to(self.device)
            for k, v in arrays.items()
            if k not in ("input_ids", "attention_mask")
        }
        logp = token_logprobs(self._forward(self.model, arrays), t["targets"])
        out = ppo_tis_loss(
            logp, t["behaviour_logprobs"], t["advantages"], t["loss_mask"], t["weights"],
            clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high, tis_cap=self.cfg.tis_cap,
        )  # fmt: skip
        return float(out.loss)

    def weights(self) -> dict[str, Any]:
        # Separate CPU copies: safetensors refuses tensors sharing storage (tied embeddings).
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in self.model.state_dict().items()}

    def save_state(self, path: Path) -> None:
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "rng": {
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    "numpy": np.random.get_state(),
                    "python": random.getstate(),
                },
            },
            path,
        )

    def load_state(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])

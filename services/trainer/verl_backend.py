"""verl backend: the same samples, optimised by verl's actor (``DataParallelPPOActor``).

Each step turns squall's samples into one verl ``DataProto`` laid out the way verl's PPO
actor expects - prompt left-padded, "response" right-padded - where the response is
everything from a sample's first trained token on (for merged multi-turn samples this
includes the tool/observation tokens, which ``response_mask`` zeroes, as in verl's own
multi-turn rollouts). ``old_log_probs`` are the behaviour logprobs the inference server
returned and ``advantages`` the trajectory's scalar on every response position; one call
to ``update_policy`` with ``ppo_mini_batch_size`` = the batch makes exactly one optimizer
step, micro-batched by token budget (``use_dynamic_bsz``).

Mapping of squall's loss onto verl's:
- clip_low / clip_high -> clip_ratio_low / clip_ratio_high (same ratio: to the behaviour policy)
- the policy term itself is squall's (`losses.ppo_tis_token_loss`), registered in verl as
  the policy loss mode "squall_tis" with tis_cap passed as clip_ratio_c. verl's "vanilla"
  dual clip differs in one region: a negative-advantage token whose ratio exceeds c has the
  same loss value (-A*c) but no gradient there, where TIS keeps the gradient at weight c
  (tests/test_trainer_verl.py checks both statements exactly)
- loss_agg token -> "token-mean"; trajectory -> "seq-mean-token-mean" (per sample: a
  trajectory split into several samples counts once per sample)
- kl_coef > 0 -> use_kl_loss with the k3 ("low_var_kl") estimator against a frozen copy.

One process: on a GPU the module is wrapped in FSDP (world size 1, bf16 autocast inside
verl); on CPU it stays a plain module. A multi-GPU run of verl's FSDP workers on Ray is
left to verl's own launcher (docs/trainer.md says what was validated where).
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from squall.shared.config import RunConfig

from .backend import TrainerBackend
from .losses import ppo_tis_token_loss
from .sequences import Sample
from .torch_backend import resolve_device


def require_verl() -> None:
    try:
        import verl  # noqa: F401
    except ImportError:
        raise ImportError(
            "the verl backend needs verl: pip install 'verl>=0.5' (in its own virtualenv: it pins "
            "transformers), or use --backend torch"
        ) from None


def _init_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # launched by torchrun/Ray
        dist.init_process_group(backend, rank=0, world_size=1)
        return
    # One process: rendezvous through a fresh file, not a TCP port that another process (or a
    # trainer killed a moment ago) may hold.
    import tempfile

    handle, path = tempfile.mkstemp(prefix="squall-pg-")
    os.close(handle)
    os.unlink(path)
    dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)


def to_verl_batch(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Samples -> verl's tensors. P = longest prompt, R = longest response.

    input_ids, attention_mask, position_ids (B, P+R); responses, response_mask,
    old_log_probs, advantages (B, R). Prompt = tokens before the first trained token.
    """
    firsts = []
    for s in samples:
        trained = np.flatnonzero(s.loss_mask > 0)
        firsts.append(int(trained[0]) if trained.size else s.length)
    prompt_len = max(firsts)
    response_len = max(max(s.length - f for s, f in zip(samples, firsts, strict=True)), 1)
    batch = len(samples)
    ids = np.full((batch, prompt_len + response_len), pad_id, np.int64)
    attn = np.zeros_like(ids)
    resp_mask = np.zeros((batch, response_len), np.float32)
    old_lp = np.zeros((batch, response_len), np.float32)
    adv = np.zeros((batch, response_len), np.float32)
    for b, (s, f) in enumerate(zip(samples, firsts, strict=True)):
        ids[b, prompt_len - f : prompt_len] = s.input_ids[:f]  # left-padded prompt
        attn[b, prompt_len - f : prompt_len] = 1
        n = s.length - f
        ids[b, prompt_len : prompt_len + n] = s.input_ids[f:]  # right-padded response
        attn[b, prompt_len : prompt_len + n] = 1
        resp_mask[b, :n] = s.loss_mask[f:]
        old_lp[b, :n] = s.behaviour_logprobs[f:]
        adv[b, :n] = s.advantage * s.loss_mask[f:]
    position = np.clip(np.cumsum(attn, axis=1) - 1, 0, None)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "position_ids": torch.from_numpy(position),
        "responses": torch.from_numpy(ids[:, prompt_len:].copy()),
        "response_mask": torch.from_numpy(resp_mask),
        "loss_mask": torch.from_numpy(resp_mask.copy()),  # older verl reads loss_mask in multi-turn mode
        "old_log_probs": torch.from_numpy(old_lp),
        "advantages": torch.from_numpy(adv),
    }


SQUALL_LOSS_MODE = "squall_tis"  # verl's policy_loss.loss_mode for squall's PPO-clip + TIS


def squall_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """squall's policy term in verl's policy-loss signature, all (B, R): returns (pg_loss,
    clip fraction, ppo_kl, TIS fraction); `config` is the actor config (clip_ratio_low/high,
    clip_ratio_c = tis_cap)."""
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo.core_algos import agg_loss

    cap = float(config.clip_ratio_c)
    pg, ratio, clipped = ppo_tis_token_loss(
        log_prob, old_log_prob, advantages,
        clip_low=float(config.clip_ratio_low), clip_high=float(config.clip_ratio_high), tis_cap=cap,
    )  # fmt: skip
    pg_loss = agg_loss(loss_mat=pg, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
    ppo_kl = verl_F.masked_mean(old_log_prob - log_prob, response_mask)
    return (
        pg_loss, verl_F.masked_mean(clipped.float(), response_mask), ppo_kl.detach(),
        verl_F.masked_mean((ratio.detach() > cap).float(), response_mask),
    )  # fmt: skip


def register_squall_loss() -> None:
    """Make SQUALL_LOSS_MODE known to verl's policy-loss registry (idempotent)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    POLICY_LOSS_REGISTRY.setdefault(SQUALL_LOSS_MODE, squall_policy_loss)


def _patch_cpu_memory_probe() -> None:
    """verl's GPUMemoryLogger asks the device for allocated memory even on CPU, where
    torch.cpu has no such call; on CPU report zeros so the actor's update can run."""
    try:
        from verl.utils.profiler import performance
    except ImportError:  # older layout
        from verl.utils import debug as performance  # type: ignore[no-redef]
    if hasattr(performance, "_get_current_mem_info"):
        performance._get_current_mem_info = lambda *_, **__: ("0", "0", "0", "0")


class VerlBackend(TrainerBackend):
    def __init__(self, config: RunConfig) -> None:
        require_verl()
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        self.cfg = config.trainer
        self.device = resolve_device(self.cfg.device)
        _init_process_group(self.device)
        if self.device.type == "cpu":
            _patch_cpu_memory_probe()
        register_squall_loss()
        torch.manual_seed(config.run.seed)
        self.model = AutoModelForCausalLM.from_pretrained(config.model.path, dtype=torch.float32).to(
            self.device
        )
        self.model.config.use_cache = False
        self.vocab_size = int(self.model.config.vocab_size)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        module: torch.nn.Module = self.model
        if self.device.type == "cuda":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            module = FSDP(self.model, use_orig_params=True, device_id=self.device)
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=self.cfg.lr, weight_decay=0.0)
        self.actor_config = OmegaConf.create({
            "strategy": "fsdp", "ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 1,
            "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": self.cfg.max_tokens_per_microbatch,
            "ppo_epochs": 1, "shuffle": False, "grad_clip": self.cfg.grad_clip,
            "clip_ratio": self.cfg.clip_low, "clip_ratio_low": self.cfg.clip_low,
            "clip_ratio_high": self.cfg.clip_high, "clip_ratio_c": self.cfg.tis_cap,
            "entropy_coeff": 0.0, "calculate_entropy": True,
            "loss_agg_mode": "token-mean" if self.cfg.loss_agg == "token" else "seq-mean-token-mean",
            "use_kl_loss": self.cfg.kl_coef > 0, "kl_loss_coef": self.cfg.kl_coef, "kl_loss_type": "low_var_kl",
            "ulysses_sequence_parallel_size": 1, "use_remove_padding": False, "use_fused_kernels": False,
            "use_torch_compile": False, "entropy_from_logits_with_chunking": False, "entropy_checkpointing": False,
            "policy_loss": {"loss_mode": SQUALL_LOSS_MODE}, "checkpoint": {},
        })  # fmt: skip
        self.actor = DataParallelPPOActor(self.actor_config, module, self.optimizer)
        self.reference = None
        if self.cfg.kl_coef > 0:
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.reference = DataParallelPPOActor(self.actor_config, ref, None)

    def _proto(self, samples: Sequence[Sample]) -> Any:
        from verl import DataProto

        tensors = {k: v.to(self.device) for k, v in to_verl_batch(samples, self.pad_id).items()}
        meta = {"temperature": 1.0, "multi_turn": True, "micro_batch_size": 1, "use_dynamic_bsz": True,
                "max_token_len": self.cfg.max_tokens_per_microbatch}  # fmt: skip
        return DataProto.from_dict(tensors=tensors, meta_info=meta)

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        data = self._proto(samples)
        self.actor_config.ppo_mini_batch_size = len(samples)  # one optimizer step per call
        if self.reference is not None:
            ref_logp, _ = self.reference.compute_log_prob(data, calculate_entropy=False)
            data.batch["ref_log_prob"] = ref_logp
        logp, entropy = self.actor.compute_log_prob(data, calculate_entropy=True)
        mask = data.batch["response_mask"] > 0
        ratio = torch.exp(logp - data.batch["old_log_probs"])[mask]
        raw = self.actor.update_policy(data)
        tokens = int(mask.sum())

        def mean(name: str) -> float:
            values = raw.get(name, [0.0])
            values = values if isinstance(values, list) else [values]
            return float(np.mean([float(v) for v in values])) if values else 0.0

        return {
            "loss": mean("actor/pg_loss") + self.cfg.kl_coef * mean("actor/kl_loss"),
            "pg_loss": mean("actor/pg_loss"),
            "kl": mean("actor/kl_loss"),
            "clip_fraction": mean("actor/pg_clipfrac"),
            "tis_fraction": mean("actor/pg_clipfrac_lower"),
            "ratio_mean": float(ratio.mean()) if ratio.numel() else 0.0,
            "entropy": float(entropy[mask].mean()) if tokens and entropy is not None else 0.0,
            "grad_norm": mean("actor/grad_norm"),
            "tokens": float(tokens),
            "microbatches": float(len(raw.get("actor/pg_loss", []) or [0])),
        }

    def _state_dict(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.state_dict_type(
                self.module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)
            ):
                return self.module.state_dict()
        return self.model.state_dict()

    def weights(self) -> dict[str, Any]:
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in self._state_dict().items()}

    def save_state(self, path: Path) -> None:
        torch.save({"model": self.weights(), "optimizer": self.optimizer.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}},
                   path)  # fmt: skip

    def load_state(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        if self.device.type == "cuda":
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.state_dict_type(
                self.module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)
            ):
                self.module.load_state_dict(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])

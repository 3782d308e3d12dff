"""verl backend: the same samples, optimised by verl's FSDP training engine (verl 0.9).

verl 0.9 replaced the PPO actor class this backend used to drive (``DataParallelPPOActor``)
with training engines: ``FSDPEngineWithLMHead`` builds the Hugging Face model, shards it with
FSDP2 (``fully_shard`` per decoder layer, then the root) over the process group it finds,
builds the optimizer, and runs ``train_batch(data, loss_function)``: micro-batches by token
budget (``use_dynamic_bsz``), forward, the loss, backward, gradient clipping, one optimizer
step. The loss function is verl's own PPO loss (``verl.workers.utils.losses.ppo_loss``); the
policy term inside it is squall's, registered as the policy-loss mode "squall_tis".

Each step turns squall's samples into verl's batch: prompt left-padded, "response" right-padded,
where the response is everything from a sample's first trained token on (for merged multi-turn
samples this includes the tool/observation tokens, which ``response_mask`` zeroes, as in verl's
own multi-turn rollouts), then verl's ``left_right_2_no_padding`` makes it the jagged batch the
engine reads. ``old_log_probs`` are the behaviour logprobs the inference server returned and
``advantages`` the trajectory's scalar on every response position.

Mapping of squall's loss onto verl's:
- clip_low / clip_high -> clip_ratio_low / clip_ratio_high (same ratio: to the behaviour policy)
- the policy term itself is squall's (`losses.ppo_tis_token_loss`), tis_cap passed as
  clip_ratio_c. verl's "vanilla" dual clip differs in one region: a negative-advantage token
  whose ratio exceeds c has the same loss value (-A*c) but no gradient there, where TIS keeps
  the gradient at weight c (tests/test_trainer_verl.py checks both statements exactly)
- loss_agg token -> "token-mean"; trajectory -> "seq-mean-token-mean" (per sample: a
  trajectory split into several samples counts once per sample), both normalised by the
  whole step across ranks: verl all-reduces the step's token count, and is told the step's
  sample count (``global_batch_size``)
- kl_coef > 0 -> use_kl_loss with the k3 ("low_var_kl") estimator against a frozen copy
  (a forward-only engine).

Ranks: every rank is handed the whole step (the rank protocol in distributed.py) and trains
on its share of the samples (round robin); verl keeps the micro-batch count equal on every
rank. On CPU verl has no platform of its own: verl_cpu.py adds one (gloo). Precision: fp32 on
CPU, bf16 parameters with fp32 gradient reduction on CUDA (verl's default there).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from squall.shared.config import RunConfig, TrainerSection

from .backend import TrainerBackend
from .losses import ppo_tis_token_loss
from .sequences import Sample

VERL_SERIES = (0, 9)  # the engine API this backend is written against
SQUALL_LOSS_MODE = "squall_tis"  # verl's policy_loss.loss_mode for squall's PPO-clip + TIS


def require_verl() -> None:
    try:
        import verl
    except ImportError:
        raise ImportError(
            "the verl backend needs verl 0.9: pip install 'verl>=0.9,<0.10' (in its own virtualenv: "
            "it pins transformers; `make test-verl` builds one), or use --backend torch"
        ) from None
    have = tuple(int(part) for part in verl.__version__.split(".")[:2])
    if have != VERL_SERIES:
        raise ImportError(
            f"verl {verl.__version__} is installed, but the verl backend drives verl "
            f"{'.'.join(map(str, VERL_SERIES))}'s training engine (older verl has no engine, newer "
            "may have changed it): pip install 'verl>=0.9,<0.10', or use --backend torch"
        )


def to_verl_batch(samples: Sequence[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Samples -> verl's left/right padded tensors. P = longest prompt, R = longest response.

    input_ids, attention_mask, position_ids (B, P+R); prompts (B, P); responses,
    response_mask, old_log_probs, advantages (B, R). Prompt = tokens before the first trained
    token.
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
        adv[b, :n] = s.token_advantages()[f:] * s.loss_mask[f:]
    position = np.clip(np.cumsum(attn, axis=1) - 1, 0, None)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "position_ids": torch.from_numpy(position),
        "prompts": torch.from_numpy(ids[:, :prompt_len].copy()),
        "responses": torch.from_numpy(ids[:, prompt_len:].copy()),
        "response_mask": torch.from_numpy(resp_mask),
        "old_log_probs": torch.from_numpy(old_lp),
        "advantages": torch.from_numpy(adv),
    }


def squall_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """squall's policy term in verl 0.9's policy-loss signature, tensors all (B, R): returns
    (pg_loss, metrics) with verl's metric names: pg_clipfrac (PPO clip), pg_clipfrac_lower
    (ratio past the TIS cap), ppo_kl. `config` is the actor config (clip_ratio_low/high,
    clip_ratio_c = tis_cap, and global_batch_info: the step's token and sample counts across
    ranks, which agg_loss normalises by). Rollout-correction weights multiply the token terms
    as they do in verl's own losses."""
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo.core_algos import agg_loss

    cap = float(config.clip_ratio_c)
    pg, ratio, clipped = ppo_tis_token_loss(
        log_prob,
        old_log_prob,
        advantages,
        clip_low=float(config.clip_ratio_low),
        clip_high=float(config.clip_ratio_high),
        tis_cap=cap,
    )
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    batch_info = dict(config.get("global_batch_info") or {})
    pg_loss = agg_loss(loss_mat=pg, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    mask = response_mask.float()
    return pg_loss, {
        "actor/pg_clipfrac": verl_F.masked_mean(clipped.float(), mask).item(),
        "actor/pg_clipfrac_lower": verl_F.masked_mean((ratio.detach() > cap).float(), mask).item(),
        "actor/ppo_kl": verl_F.masked_mean(old_log_prob - log_prob.detach(), mask).item(),
    }


def register_squall_loss() -> None:
    """Make SQUALL_LOSS_MODE known to verl's policy-loss registry (idempotent)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    POLICY_LOSS_REGISTRY.setdefault(SQUALL_LOSS_MODE, squall_policy_loss)


def verl_actor_config(cfg: TrainerSection, loss_mode: str = SQUALL_LOSS_MODE) -> Any:
    """The verl actor config squall's trainer section maps to (the loss's settings)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=cfg.max_tokens_per_microbatch,
        clip_ratio=cfg.clip_low,
        clip_ratio_low=cfg.clip_low,
        clip_ratio_high=cfg.clip_high,
        clip_ratio_c=cfg.tis_cap,
        loss_agg_mode="token-mean" if cfg.loss_agg == "token" else "seq-mean-token-mean",
        entropy_coeff=0.0,
        calculate_entropy=True,
        use_kl_loss=cfg.kl_coef > 0,
        kl_loss_coef=cfg.kl_coef,
        kl_loss_type="low_var_kl",
        use_torch_compile=False,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


def build_engine(config: RunConfig, device: torch.device, *, forward_only: bool = False) -> Any:
    """verl's FSDP2 engine for the policy at config.model.path, initialised (model sharded over
    the current process group, optimizer built unless forward_only)."""
    if device.type == "cpu":
        from .verl_cpu import install_cpu_platform

        install_cpu_platform()  # before the engine module is imported: it reads the device then
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    cfg = config.trainer
    # sdpa, whole sequences: what the torch backend runs, on any device (no flash-attn varlen).
    model = HFModelConfig(
        path=config.model.path,
        load_tokenizer=False,
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        override_config={"attn_implementation": "sdpa"},
    )
    precision = "fp32" if device.type == "cpu" else "bf16"
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        forward_only=forward_only,
        use_torch_compile=False,
        mixed_precision={"param_dtype": precision, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_dynamic_bsz=True,
        use_remove_padding=False,
        seed=config.run.seed,
        max_token_len_per_gpu=cfg.max_tokens_per_microbatch,
        infer_max_token_len_per_gpu=cfg.max_tokens_per_microbatch,
    )
    optimizer = FSDPOptimizerConfig(
        lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.999), clip_grad=cfg.grad_clip, lr_warmup_steps=0
    )
    torch.manual_seed(config.run.seed)
    engine = FSDPEngineWithLMHead(model, engine_config, optimizer, CheckpointConfig())
    engine.initialize()
    return engine


def _init_process_group(cfg: TrainerSection, device: torch.device) -> Any:
    """The trainer's world: a launcher's (torchrun, Ray Train) when there is one, else a
    process group of one (verl's engine shards over a process group whatever its size)."""
    import os
    import tempfile

    import torch.distributed as dist

    from .distributed import current_world, init_world

    world = current_world()
    if world.distributed or dist.is_initialized():
        return init_world(cfg.device, cfg.collective_timeout_s)
    # One process: rendezvous through a fresh file, not a TCP port that another process (or a
    # trainer killed a moment ago) may hold.
    handle, path = tempfile.mkstemp(prefix="squall-pg-")
    os.close(handle)
    os.unlink(path)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)
    return current_world()


class VerlBackend(TrainerBackend):
    def __init__(self, config: RunConfig) -> None:
        require_verl()
        from .distributed import rank_device, resolve_device

        if not config.model.path:
            raise ValueError("model.path is empty: set it to the initial policy's transformers folder")
        self.cfg = config.trainer
        self.world = _init_process_group(self.cfg, resolve_device(self.cfg.device))
        self.device = rank_device(self.cfg.device, self.world)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        register_squall_loss()
        self.engine = build_engine(config, self.device)
        self.module = self.engine.module  # the FSDP2-sharded Hugging Face model
        self.model = self.module
        self.optimizer = self.engine.optimizer
        hf_config = self.module.config
        self.vocab_size = int(hf_config.vocab_size)
        self.pad_id = int(hf_config.pad_token_id) if hf_config.pad_token_id is not None else 0
        self.actor_config = verl_actor_config(self.cfg)
        self.reference = None
        if self.cfg.kl_coef > 0:
            # verl offloads a forward-only engine's parameters to pinned host memory, which needs
            # an accelerator; on CPU the reference is a training engine that never steps (AdamW
            # allocates its state on the first step, so it costs the same).
            self.reference = build_engine(config, self.device, forward_only=self.device.type != "cpu")

    # --- one step -------------------------------------------------------------------
    def _batch(self, samples: Sequence[Sample], step_samples: int, *, train: bool) -> Any:
        """This rank's samples as verl's jagged TensorDict, with the settings the engine reads."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        tensors = to_verl_batch(samples, self.pad_id)
        data = left_right_2_no_padding(tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={}))
        longest = max(s.length for s in samples)  # verl refuses a sample longer than the budget
        tu.assign_non_tensor(
            data,
            temperature=1.0,
            use_remove_padding=False,
            use_fused_kernels=False,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=max(self.cfg.max_tokens_per_microbatch, longest),
            micro_batch_size_per_gpu=1,
            calculate_entropy=train,
            global_batch_size=step_samples,
            pad_token_id=self.pad_id,
        )
        return data

    def _loss(
        self, model_output: dict[str, Any], data: Any, dp_group: Any = None
    ) -> tuple[torch.Tensor, dict]:
        """verl's PPO loss (with squall's policy term), plus what the step's metrics need from
        the same forward: per micro-batch sums over its trained tokens."""
        from verl.utils.metric.utils import AggregationType, Metric
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        loss, metrics = ppo_loss(self.actor_config, model_output, data, dp_group)
        padded = data.select("response_mask", "old_log_probs").to_padded_tensor()
        mask = padded["response_mask"] > 0  # (B, R)
        logp = no_padding_2_padding(model_output["log_probs"], data).detach()  # (B, R)
        entropy = no_padding_2_padding(model_output["entropy"], data).detach()
        tokens = float(mask.sum())

        def total(value: Any) -> Metric:
            return Metric(AggregationType.SUM, float(value))

        metrics["squall/tokens"] = total(tokens)
        metrics["squall/ratio"] = total(torch.exp(logp - padded["old_log_probs"])[mask].sum())
        metrics["squall/entropy"] = total(entropy[mask].sum())
        metrics["squall/clip"] = total(metrics["actor/pg_clipfrac"].values[0] * tokens)
        metrics["squall/tis"] = total(metrics["actor/pg_clipfrac_lower"].values[0] * tokens)
        return loss, metrics

    def _ref_log_probs(self, samples: Sequence[Sample], step_samples: int) -> torch.Tensor:
        """The frozen reference's log-probs of the responses, (B, R)."""
        from verl.workers.utils.padding import no_padding_2_padding

        assert self.reference is not None
        data = self._batch(samples, step_samples, train=False)
        with self.reference.eval_mode():
            out = self.reference.infer_batch(data)
        return no_padding_2_padding(out["model_output"]["log_probs"], data).float().cpu()

    def _share(self, samples: Sequence[Sample]) -> list[Sample]:
        if len(samples) < self.world.world_size:
            raise ValueError(
                f"a step of {len(samples)} sample(s) cannot be shared by {self.world.world_size} ranks: "
                "raise trainer.batch_size or launch fewer ranks"
            )
        return list(samples[self.world.rank :: self.world.world_size])

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        mine = self._share(samples)
        data = self._batch(mine, len(samples), train=True)
        if self.reference is not None:
            data["ref_log_prob"] = self._ref_log_probs(mine, len(samples))
        with self.engine.train_mode():
            out = self.engine.train_batch(data, loss_function=self._loss)
        raw = out["metrics"]
        sums = {
            "pg": raw["actor/pg_loss"].aggregate(),  # each micro-batch's share of the step, x ranks
            "kl": raw["kl_loss"].aggregate() if "kl_loss" in raw else 0.0,
            "microbatches": float(len(raw["actor/pg_loss"].values)),
            **{
                name: raw[f"squall/{name}"].aggregate()
                for name in ("tokens", "ratio", "entropy", "clip", "tis")
            },
        }
        sums = {name: float(value) for name, value in sums.items()}  # verl aggregates to numpy floats
        if self.world.distributed:
            from .distributed import all_reduce_sums

            sums = all_reduce_sums(sums, self.device)
        ranks = self.world.world_size  # verl scales each rank's loss by the rank count (gradients average)
        n = max(sums["tokens"], 1.0)
        pg, kl = sums["pg"] / ranks, sums["kl"] / ranks
        return {
            "loss": pg + self.cfg.kl_coef * kl,
            "pg_loss": pg,
            "kl": kl,
            "clip_fraction": sums["clip"] / n,
            "tis_fraction": sums["tis"] / n,
            "ratio_mean": sums["ratio"] / n,
            "entropy": sums["entropy"] / n,
            "grad_norm": float(raw["grad_norm"]),
            "tokens": float(sums["tokens"]),
            "microbatches": float(sums["microbatches"]),
        }

    # --- weights and state -------------------------------------------------------------
    def weights(self) -> dict[str, Any]:
        """The full state dict on rank 0 ({} on the others); every rank must call it."""
        from .distributed import full_state_dict

        # Separate copies: safetensors refuses tensors sharing storage (tied embeddings).
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in full_state_dict(self.module).items()}

    def _rng(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def _set_rng(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"].cpu())
        if rng.get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])

    def save_state(self, path: Path) -> None:
        """One rank: model, optimizer and RNG in one file. Several: a folder of
        torch.distributed.checkpoint shards and one RNG file per rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        from .distributed import save_sharded

        if self.world.distributed:
            save_sharded(path, self.module, self.optimizer, self._rng(), self.world)
            return
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optimizer = get_state_dict(self.module, self.optimizer, options=full)
        torch.save({"model": model, "optimizer": optimizer, "rng": self._rng()}, path)

    def load_state(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from .distributed import WorldSizeError, load_sharded

        if self.world.distributed:
            self._set_rng(load_sharded(path, self.module, self.optimizer, self.world))
            return
        if path.is_dir():
            raise WorldSizeError(
                f"{path} is a checkpoint written by several ranks: resume it with as many ranks"
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        self._set_rng(state["rng"])

"""LoRA training (`trainer.lora_rank` > 0): the loaded transformers model wrapped by peft.

Only the adapter matrices (A, B of each targeted linear layer) require gradients, so the
optimizer holds and checkpoints only them; the base weights stay exactly as loaded. The KL
reference is the same model with its adapter disabled (no second copy of the base). What is
published is the adapter alone, in peft's layout: `adapter_model.safetensors` (tensor names
`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`) and `adapter_config.json`, so
an inference node, vLLM, or `PeftModel.from_pretrained` loads it on top of the same base.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from squall.shared.config import TrainerSection
from squall.shared.errors import ConfigError

TARGETS_FIELD = "trainer.lora_target_modules"


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Last path components of the model's linear layers (what peft's target_modules match)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def matches(module_name: str, target: str) -> bool:
    """peft's rule for a target_modules entry: the module's whole name, or its last parts."""
    return module_name == target or module_name.endswith("." + target)


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """ConfigError naming the config field when a target matches no linear layer of `model`
    (by peft's rule: a layer's name or its trailing parts, e.g. `q_proj`, `self_attn.q_proj`)."""
    modules = [(name, m) for name, m in model.named_modules() if name]
    unknown = [
        t for t in targets if not any(matches(n, t) and isinstance(m, torch.nn.Linear) for n, m in modules)
    ]
    if unknown:
        kinds = {t: type(m).__name__ for t in unknown for n, m in modules if matches(n, t)}
        said = ", ".join(f"{t!r} (a {kinds[t]})" if t in kinds else repr(t) for t in unknown)
        raise ConfigError(
            f"{TARGETS_FIELD}: {said} is no linear layer of this model; its linear layers are "
            f"{', '.join(linear_layer_names(model))}: set {TARGETS_FIELD} to some of these"
        )
    tied = getattr(model.config, "tie_word_embeddings", False)
    output = model.get_output_embeddings()
    if tied and output is not None:
        head = next((n for n, m in modules if m is output), "")
        clash = [t for t in targets if matches(head, t)]
        if clash:
            raise ConfigError(
                f"{TARGETS_FIELD}: {clash[0]!r} is {head!r}, which shares its weight with the input "
                "embeddings (tie_word_embeddings), so its adapter cannot be merged into the served "
                f"model; leave {clash[0]!r} out"
            )


def lora_config(cfg: Any) -> Any:
    """peft's LoraConfig for a trainer section's `lora_*` fields (one role's, in a roles run)."""
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, cfg: TrainerSection, base_path: str) -> Any:
    """The peft model training only rank-`cfg.lora_rank` adapters on `cfg.lora_target_modules`."""
    from peft import get_peft_model

    check_targets(model, list(cfg.lora_target_modules))
    peft_model = get_peft_model(model, lora_config(cfg))
    peft_model.peft_config["default"].base_model_name_or_path = base_path
    return peft_model


def adapter_config(peft_model: Any, adapter: str = "default") -> dict[str, Any]:
    """adapter_config.json's content, as peft writes it (sets as sorted lists)."""
    raw = peft_model.peft_config[adapter].to_dict()
    out = {k: sorted(v) if isinstance(v, set) else v for k, v in raw.items()}
    return json.loads(json.dumps(out, default=str))  # enums (PeftType) as their strings


def adapter_weights(
    peft_model: Any, *, gather: bool = False, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names, as separate contiguous CPU copies.
    `gather`: the model is sharded (FSDP2); only the trainable tensors are gathered, to rank 0
    (the other ranks get {}), never the frozen base."""
    from peft import get_peft_model_state_dict

    state = None
    if gather:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(peft_model, options=options)
        if not state:
            return {}
    tensors = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter)
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}


def check_checkpoint_rank(saved: int, configured: int, where: str) -> None:
    """ConfigError when a checkpoint was trained with another LoRA setting than this run's."""
    if saved != configured:
        said = {0: "every weight (no LoRA)"}
        raise ConfigError(
            f"checkpoint {where} trained {said.get(saved, f'rank-{saved} LoRA adapters')}, but "
            f"trainer.lora_rank = {configured}: resume with lora_rank = {saved}, or start from a new run.dir"
        )


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (the adapters), by their names in the wrapped model."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Put a checkpoint's adapter tensors back; ConfigError when they do not fit this model."""
    expected = set(trainable_state(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ConfigError(
            f"checkpoint {where} does not hold this run's LoRA adapters (missing {missing[:3]}, "
            f"unexpected {extra[:3]}): resume with the trainer.lora_* settings it was written with, "
            "or start from a new run.dir"
        )
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise ConfigError(
                    f"checkpoint {where}: adapter {name} has shape {tuple(tensor.shape)}, this run's is "
                    f"{tuple(params[name].shape)} (another trainer.lora_rank?): resume with the settings "
                    "it was written with, or start from a new run.dir"
                )
            params[name].copy_(tensor)


class AdapterDisabled:
    """The frozen base as a KL reference: the peft model called with its adapter off, in eval mode."""

    def __init__(self, peft_model: Any) -> None:
        self.peft_model = peft_model

    def get_base_model(self) -> Any:
        """The transformers model under the adapters, as peft's own wrapper names it (whose
        forward's keywords shared/transformers_compat.py reads)."""
        return self.peft_model.get_base_model()

    def __call__(self, **inputs: Any) -> Any:
        was_training = self.peft_model.training
        self.peft_model.eval()
        try:
            with self.peft_model.disable_adapter():
                return self.peft_model(**inputs)
        finally:
            self.peft_model.train(was_training)

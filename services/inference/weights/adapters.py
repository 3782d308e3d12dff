"""A published LoRA adapter (shared.adapterfiles has the layout) applied to the torch engine's
base model by merging: each adapted linear layer's weight becomes W + scale * B @ A.

Why merge rather than run the adapter beside the base (peft's set_adapter): a merged model's
forward is a plain forward, so serving costs nothing per token; applying a version costs one
rank-r product per adapted layer, once. The merged model is a copy of the pristine base that
shares every tensor the adapter does not touch, so a new version replaces the previous adapter
rather than stacking on it, and the extra memory is one copy of the adapted weights.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from squall.shared.adapterfiles import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from squall.shared.errors import WeightsError

UNSUPPORTED = {  # adapter_config.json fields whose non-default value this merge does not handle
    "use_dora": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "trainable_token_indices": None,
}


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(
            f"load: {path} is not a peft LoRA config (needs r and lora_alpha): {exc!r}"
        ) from None
    if config.get("peft_type", "LORA") != "LORA" or r < 1:
        raise WeightsError(
            f"format: {path} is not a LoRA adapter (peft_type {config.get('peft_type')!r}, r {r})"
        )
    odd = [k for k, default in UNSUPPORTED.items() if config.get(k) not in (default, None, {}, [])]
    if odd:
        raise WeightsError(f"format: {path} sets {odd}, which a merged LoRA cannot serve; train without them")
    config["scale"] = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return config


def adapter_pairs(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A (r, in), B (out, r)) from adapter_model.safetensors."""
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a bad file
        raise WeightsError(f"load: cannot read adapter {path}: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("A", "B"):
            suffix = f".lora_{part}.weight"
            if name.endswith(suffix):
                pairs.setdefault(name.removesuffix(suffix), {})[part] = tensor
                break
        else:
            raise WeightsError(f"format: adapter {path} holds {key!r}, which is no lora_A/lora_B weight")
    broken = [name for name, pair in pairs.items() if set(pair) != {"A", "B"}]
    if broken or not pairs:
        raise WeightsError(f"format: adapter {path} lacks lora_A or lora_B for {broken[:3] or 'every layer'}")
    return {name: (pair["A"], pair["B"]) for name, pair in pairs.items()}


def read_adapter(folder: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, Any]]:
    """(module name -> (A, B), config with its `scale`) of the adapter in `folder`."""
    folder = Path(folder)
    return adapter_pairs(folder), read_config(folder)


def check_fits(name: str, a: torch.Tensor, b: torch.Tensor, weight: Any, config: dict, where: Path) -> None:
    """WeightsError unless B @ A has the shape of the base weight it is added to."""
    shape = (a.shape[1], b.shape[0]) if config.get("fan_in_fan_out") else (b.shape[0], a.shape[1])
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape or a.shape[0] != b.shape[1]:
        raise WeightsError(
            f"load: adapter {where} for {name!r} (A {tuple(a.shape)}, B {tuple(b.shape)}) does not fit "
            f"its base weight {tuple(weight.shape) if isinstance(weight, torch.Tensor) else None}"
        )


@torch.no_grad()
def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: dict) -> torch.Tensor:
    """weight + scale * B @ A, summed in float32 and rounded once to the weight's dtype (a
    bf16 base would otherwise round the delta as well)."""
    a32, b32 = a.to(weight.device, torch.float32), b.to(weight.device, torch.float32)
    delta = (b32 @ a32) * config["scale"]  # (out, in)
    return (weight.float() + (delta.T if config.get("fan_in_fan_out") else delta)).to(weight.dtype)


def adapted_module(
    base: torch.nn.Module, name: str, a: torch.Tensor, b: torch.Tensor, config: dict[str, Any], folder: Path
) -> torch.nn.Module:
    """The module of `base` the adapter's pair (A, B) for `name` adapts, checked to fit it;
    WeightsError naming the adapter when the base lacks it or the shapes disagree."""
    try:
        module = base.get_submodule(name)
    except AttributeError:
        raise WeightsError(f"load: adapter {folder} adapts {name!r}, which the base model lacks") from None
    check_fits(name, a, b, getattr(module, "weight", None), config, folder)
    return module


def merged_copy(base: torch.nn.Module, folder: str | Path) -> torch.nn.Module:
    """A copy of `base` serving the adapter in `folder`; `base` is left untouched. Raises
    WeightsError when the adapter does not fit the base (a module it lacks, a shape)."""
    folder = Path(folder)
    pairs, config = read_adapter(folder)
    targets: dict[str, torch.Tensor] = {}  # module name -> its base weight
    for name, (a, b) in pairs.items():
        targets[name] = adapted_module(base, name, a, b, config, folder).weight
    adapted = {id(w) for w in targets.values()}
    shared = {id(t): t for t in [*base.parameters(), *base.buffers()] if id(t) not in adapted}
    model = copy.deepcopy(base, memo=shared)  # new tensors only for the adapted weights
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            weight = model.get_submodule(name).weight
            weight.copy_(merged(weight, a, b, config))
    return model.eval()


def merge_into_state(state: dict[str, torch.Tensor], folder: str | Path) -> dict[str, torch.Tensor]:
    """The base state dict `state` with the adapter in `folder` merged in (a new dict; the
    adapted tensors are new, the others shared), as `squall export` writes a LoRA version."""
    folder = Path(folder)
    pairs, config = read_adapter(folder)
    out = dict(state)
    for name, (a, b) in pairs.items():
        key = f"{name}.weight"
        if key not in state:
            raise WeightsError(f"load: adapter {folder} adapts {name!r}, which the base model lacks")
        check_fits(name, a, b, state[key], config, folder)
        out[key] = merged(state[key], a, b, config)
    return out

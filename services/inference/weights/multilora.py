"""Many LoRA adapters served beside one base model in the same forward: every row of a batch
picks its own adapter (or none, the base).

Each adapted linear layer gets a forward hook that adds, to the base layer's output, the row's
own delta `x @ A_row^T @ B_row^T` (the scale folded into B at load). The adapters' tensors
are kept stacked per layer, one slot per adapter: A (slots, r, in) and B (slots, out, r),
zero-padded to the largest rank and zero in slot 0 (the base), so one forward costs two
batched matmuls per adapted layer however many adapters the batch mixes: the rows' A and B
are gathered by slot (`rows`, set before each forward) and no row waits for another adapter.

Why hooks on the model's own Linear modules rather than peft's `adapter_names=` batches: peft
groups rows by adapter and loops over the groups in every layer (one small matmul per adapter
per layer), and wrapping the model in a PeftModel changes the module tree the KV-cache path
and the merged single-policy path rely on. The gathered form costs the same for 1 or 4
adapters (benchmarks/multilora.py measures both against the base).

The bank is owned by one thread (the engine's): slots are filled and freed between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from squall.inference.weights.adapters import adapted_module, read_adapter
from squall.shared.errors import WeightsError

BASE_SLOT = 0  # the row serves the base model: its delta is zero


@dataclass
class LoadedAdapter:
    """One adapter read from disk and checked against the base: module -> (A, B * scale)."""

    folder: str
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int


def load_adapter(base: torch.nn.Module, folder: str | Path, dtype: torch.dtype, device: Any) -> LoadedAdapter:
    """Read the adapter in `folder` and check every pair fits `base` (WeightsError if not).
    B carries the scale (alpha / r, or alpha / sqrt(r) with rslora), so the hook multiplies
    nothing."""
    folder = Path(folder)
    pairs, config = read_adapter(folder)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (a, b) in pairs.items():
        adapted_module(base, name, a, b, config, folder)
        scaled = b.to(torch.float32) * config["scale"]
        out[name] = (a.to(device, dtype), scaled.to(device, dtype))
    return LoadedAdapter(str(folder), out, rank=max(a.shape[0] for a, _ in out.values()))


@dataclass
class _Layer:
    """The stacked adapters of one linear layer: A (slots, r, in), B (slots, out, r)."""

    a: torch.Tensor
    b: torch.Tensor
    hook: Any = field(default=None, repr=False)


class AdapterBank:
    """Slots of adapters hooked into `model`'s linear layers; row i of the next forward adds
    the delta of slot `rows[i]`."""

    def __init__(self, model: torch.nn.Module, *, slots: int) -> None:
        if slots < 2:
            raise ValueError("an adapter bank needs at least 2 slots (the base and one adapter)")
        self.model, self.slots = model, slots
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.rank = 0  # the largest rank held: every layer's stack is padded to it
        self.layers: dict[str, _Layer] = {}
        self.held: dict[int, LoadedAdapter] = {}  # slot -> adapter (slot 0 is never held)
        self.rows: torch.Tensor | None = None  # (B,) slot per row; None or all zero: the base alone

    def free_slot(self) -> int | None:
        return next((s for s in range(1, self.slots) if s not in self.held), None)

    def put(self, adapter: LoadedAdapter) -> int:
        """Place `adapter` in a free slot and return it (WeightsError when every slot is held)."""
        slot = self.free_slot()
        if slot is None:
            raise WeightsError(
                f"load: all {self.slots - 1} adapter slots are in use; adapter {adapter.folder} waits"
            )
        if adapter.rank > self.rank:
            self._grow_rank(adapter.rank)
        for name, (a, b) in adapter.pairs.items():
            layer = self.layers.get(name) or self._add_layer(name, a.shape[1], b.shape[0])
            layer.a[slot].zero_()
            layer.b[slot].zero_()
            layer.a[slot, : a.shape[0]] = a
            layer.b[slot, :, : b.shape[1]] = b
        self.held[slot] = adapter
        return slot

    def drop(self, slot: int) -> None:
        """Free `slot` (no row may still use it): its tensors become zero, the base."""
        adapter = self.held.pop(slot, None)
        if adapter is None:
            return
        for name in adapter.pairs:
            self.layers[name].a[slot].zero_()
            self.layers[name].b[slot].zero_()

    def close(self) -> None:
        """Remove every hook: the model is the plain base again."""
        for layer in self.layers.values():
            layer.hook.remove()
        self.layers.clear()
        self.held.clear()

    def _add_layer(self, name: str, in_features: int, out_features: int) -> _Layer:
        zeros = dict(dtype=self.dtype, device=self.device)
        layer = _Layer(
            torch.zeros(self.slots, self.rank, in_features, **zeros),  # type: ignore[arg-type]
            torch.zeros(self.slots, out_features, self.rank, **zeros),  # type: ignore[arg-type]
        )
        layer.hook = self.model.get_submodule(name).register_forward_hook(self._hook_for(layer))
        self.layers[name] = layer
        return layer

    def _grow_rank(self, rank: int) -> None:
        for layer in self.layers.values():
            extra = rank - layer.a.shape[1]
            layer.a = torch.cat([layer.a, layer.a.new_zeros(self.slots, extra, layer.a.shape[2])], dim=1)
            layer.b = torch.cat([layer.b, layer.b.new_zeros(self.slots, layer.b.shape[1], extra)], dim=2)
        self.rank = rank

    def _hook_for(self, layer: _Layer) -> Any:
        def add_delta(
            _module: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor | None:
            rows = self.rows
            if rows is None:
                return None
            x = inputs[0]  # (B, T, in)
            a, b = layer.a.index_select(0, rows), layer.b.index_select(0, rows)  # (B, r, in), (B, out, r)
            return output + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))

        return add_delta

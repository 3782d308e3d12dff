"""The training backend interface and the factory naming the known backends.

A backend owns the model and optimizer. It is fed the same samples (sequences.Sample, with
the trajectory advantage on every token) whatever it is, and returns the same metric names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from squall.shared.config import RunConfig

from .sequences import Sample

BACKENDS = {
    "torch": "squall.trainer.torch_backend:TorchBackend",
    "verl": "squall.trainer.verl_backend:VerlBackend",
}


class TrainerBackend(ABC):
    """One policy being optimised."""

    vocab_size: int  # token ids must be below this
    pad_id: int  # id used for padding

    @abstractmethod
    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step on `samples`. Returns loss, pg_loss, kl, clip_fraction,
        tis_fraction, entropy, grad_norm, tokens, microbatches."""

    @abstractmethod
    def weights(self) -> dict[str, Any]:
        """What is published to inference (CPU tensors): the HF model's full state dict, or
        with LoRA the adapter's tensors under peft's names."""

    def adapter_config(self) -> dict[str, Any] | None:
        """peft's adapter_config.json content when only a LoRA adapter trains (and is
        published); None when every weight trains."""
        return None

    @abstractmethod
    def save_state(self, path: Path) -> None:
        """Model, optimizer and RNG state to one file."""

    @abstractmethod
    def load_state(self, path: Path) -> None:
        """Restore what save_state wrote."""


def make_backend(name: str, config: RunConfig) -> TrainerBackend:
    """The backend called `name`; an unknown name raises ValueError listing the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown trainer backend {name!r}: known are {', '.join(sorted(BACKENDS))}")
    import importlib

    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(config)

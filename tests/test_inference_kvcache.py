"""The torch engine's in-place KV cache (kvcache.py) against transformers' DynamicCache: the
same tiny model decoding the same tokens must see the same keys, values and logits, through
in-place steps, a buffer growing past GROWTH_STEP, rows dropped and leading columns trimmed
and newly prefilled rows stacked below running ones (what the engine does between steps).
transformers' own layers take the plain path of the same functions (pad and concatenate)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from squall.inference.engines.kvcache import GROWTH_STEP, RoomyLayer, _append, roomy_cache, stack_caches
from squall.inference.tiny import build_tiny_model
from squall.shared.transformers_compat import cache_arg

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_append_writes_in_place_until_the_buffer_is_full():
    cached = torch.zeros(2, 3, 0, 4)
    room = None
    for step in range(GROWTH_STEP + 5):
        column = torch.full((2, 3, 1, 4), float(step))
        cached, new_room = _append(cached, column, room)
        if 0 < step < GROWTH_STEP:
            assert new_room is room  # written into the room behind the cached columns
        room = new_room
    assert cached.shape == (2, 3, GROWTH_STEP + 5, 4)
    assert room.shape[-2] == 2 * GROWTH_STEP
    assert torch.equal(cached[0, 0, :, 0], torch.arange(GROWTH_STEP + 5, dtype=torch.float32))


def test_a_replaced_tensor_starts_a_new_buffer_with_its_own_contents():
    cached, room = _append(torch.zeros(3, 1, 0, 2), torch.arange(18.0).view(3, 1, 3, 2), None)
    selected = cached[torch.tensor([2, 0])]  # the engine dropped row 1
    grown, new_room = _append(selected, torch.full((2, 1, 1, 2), -1.0), room)
    assert new_room is not room
    assert torch.equal(grown[:, :, :3], selected) and torch.equal(grown[:, :, 3], torch.full((2, 1, 2), -1.0))
    trimmed = grown[:, :, 1:]  # leading padding columns cut off: no longer the buffer's front
    after, trimmed_room = _append(trimmed, torch.zeros(2, 1, 1, 2), new_room)
    assert trimmed_room is not new_room and torch.equal(after[:, :, :3], trimmed)


def _decode(model, cache, prompt, steps, edit=None):
    """Greedy decode of `prompt` (B, T) for `steps` tokens; the logits of every step."""
    mask = torch.ones_like(prompt)
    out = model(input_ids=prompt, attention_mask=mask, use_cache=True, **cache_arg(model, cache))
    logits = [out.logits[:, -1]]
    for step in range(steps):
        if edit is not None and step == steps // 2:
            mask, keep = edit(cache, mask)
            logits = [row[keep] for row in logits]
        token = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = mask.sum(-1, keepdim=True) - 1
        out = model(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **cache_arg(model, cache),
        )
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def _drop_row_and_trim(cache, mask):
    """What the engine does when a row finishes: keep rows 0 and 2, cut the first column."""
    keep = torch.tensor([0, 2])
    cache.batch_select_indices(keep)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    return mask[keep][:, 1:], keep


def test_roomy_cache_decodes_like_dynamic_cache(model):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.config.vocab_size, (3, 9), generator=gen)
    steps = GROWTH_STEP + 10  # past one buffer's room
    roomy = roomy_cache(model.config)
    assert all(isinstance(layer, RoomyLayer) for layer in roomy.layers)
    with torch.inference_mode():
        expected = _decode(model, DynamicCache(config=model.config), prompt, steps)
        got = _decode(model, roomy, prompt, steps)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert roomy.get_seq_length() == 9 + steps


def test_roomy_cache_after_rows_are_dropped_and_trimmed(model):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(10, model.config.vocab_size, (3, 6), generator=gen)
    with torch.inference_mode():
        expected = _decode(model, DynamicCache(config=model.config), prompt, 20, _drop_row_and_trim)
        got = _decode(model, roomy_cache(model.config), prompt, 20, _drop_row_and_trim)
    assert got.shape == expected.shape == (2, 21, model.config.vocab_size)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def _prefill(model, cache, prompt):
    mask = torch.ones_like(prompt)
    out = model(input_ids=prompt, attention_mask=mask, use_cache=True, **cache_arg(model, cache))
    return out.logits[:, -1], mask


def _greedy_step(model, cache, logits, mask):
    """One decode step of every row on its greedy token: (next logits, the grown mask)."""
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    out = model(
        input_ids=logits.argmax(-1, keepdim=True), attention_mask=mask,
        position_ids=mask.sum(-1, keepdim=True) - 1, use_cache=True, **cache_arg(model, cache),
    )  # fmt: skip
    return out.logits[:, -1], mask


def _merged_decode(model, make_cache, running, newcomer, steps):
    """Decode `running` a few steps, stack a prefilled `newcomer` below it (left-padded to one
    width, as the engine merges admissions), decode all rows on; logits of the last steps."""
    cache = make_cache(model.config)
    logits, mask = _prefill(model, cache, running)
    for _ in range(3):
        logits, mask = _greedy_step(model, cache, logits, mask)
    other = make_cache(model.config)
    new_logits, new_mask = _prefill(model, other, newcomer)
    width = max(mask.shape[1], new_mask.shape[1])
    stack_caches(cache, other, width)
    pad = torch.nn.functional.pad
    mask = torch.cat([pad(mask, (width - mask.shape[1], 0)), pad(new_mask, (width - new_mask.shape[1], 0))])
    logits, seen = torch.cat([logits, new_logits]), []
    for _ in range(steps):
        logits, mask = _greedy_step(model, cache, logits, mask)
        seen.append(logits)
    return torch.stack(seen, 1)


@pytest.mark.parametrize("newcomer_length", [4, 12])  # shorter and longer than the running rows
def test_stacking_newcomers_matches_pad_and_concatenate(model, newcomer_length):
    gen = torch.Generator().manual_seed(newcomer_length)
    running = torch.randint(10, model.config.vocab_size, (2, 7), generator=gen)
    newcomer = torch.randint(10, model.config.vocab_size, (1, newcomer_length), generator=gen)
    with torch.inference_mode():
        expected = _merged_decode(model, lambda c: DynamicCache(config=c), running, newcomer, 12)
        got = _merged_decode(model, roomy_cache, running, newcomer, 12)
    assert got.shape == (3, 12, model.config.vocab_size)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)

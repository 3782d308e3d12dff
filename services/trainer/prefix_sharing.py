"""Micro-batches that run a shared prompt once (torch backend).

The attempts of one GRPO group start with the same prompt token for token (system message,
tools block, the task), and on an agent task that prompt is most of each sequence: on calc_real
241 of about 290 tokens. Run as separate rows, a group of 8 computes it 8 times. A micro-batch
planned here carries `prefix`, the number of leading tokens all its samples share; the backend
runs those once (batch of one, keys and values kept), repeats the cache across the rows and
runs only each sample's own tokens after it. The logprobs are those of the full forward, and so
is the gradient: the repeated cache sends every row's gradient back into the one prefix pass.

The prefix stops before the first trained token's predecessor, so every logprob the loss
reads comes from the second pass. Samples are bucketed by group and by their first
MIN_PREFIX tokens (two seats of one group with different prompts do not share); a bucket
whose common prefix is shorter than that, and every lone sample, is packed as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .sequences import Sample, pack_microbatches

# Below this many shared tokens the extra forward call costs about what it saves.
MIN_PREFIX = 32


@dataclass(frozen=True)
class Microbatch:
    """Indices into the step's samples; `prefix` leading tokens are shared by all of them
    and run once (0: every row runs whole)."""

    indices: list[int] = field(default_factory=list)
    prefix: int = 0


def common_prefix(sequences: Sequence[np.ndarray]) -> int:
    """Length of the longest prefix every sequence starts with."""
    shortest = min(len(s) for s in sequences)
    stacked = np.stack([s[:shortest] for s in sequences])
    differs = np.nonzero((stacked != stacked[0]).any(axis=0))[0]
    return int(differs[0]) if differs.size else shortest


def shareable_prefix(samples: Sequence[Sample]) -> int:
    """The prefix the samples can share: common to all of them, ending before the position
    that predicts any sample's first trained token, leaving each at least two own tokens."""
    limit = min(s.length for s in samples) - 2
    for s in samples:
        trained = np.flatnonzero(s.loss_mask > 0)
        if trained.size:
            limit = min(limit, int(trained[0]) - 1)
    return max(0, min(common_prefix([s.input_ids for s in samples]), limit))


def plan_microbatches(samples: Sequence[Sample], max_tokens: int, *, share: bool) -> list[Microbatch]:
    """The step's micro-batches. Without `share`, pack_microbatches as it is. With it, each
    bucket of samples sharing at least MIN_PREFIX tokens is packed on its own, its suffixes
    within max_tokens - prefix, so a micro-batch's rows times its longest suffix plus the
    prefix stays inside the budget."""
    if not share:
        return [Microbatch(b) for b in pack_microbatches([s.length for s in samples], max_tokens)]
    buckets: dict[tuple[str, bytes], list[int]] = {}
    rest: list[int] = []
    for i, s in enumerate(samples):
        if s.length < MIN_PREFIX + 2:
            rest.append(i)
        else:
            buckets.setdefault((s.group_id, s.input_ids[:MIN_PREFIX].tobytes()), []).append(i)
    out: list[Microbatch] = []
    for members in buckets.values():
        prefix = shareable_prefix([samples[i] for i in members]) if len(members) > 1 else 0
        if prefix < MIN_PREFIX or prefix >= max_tokens:
            rest.extend(members)
            continue
        suffixes = [samples[i].length - prefix for i in members]
        for chunk in pack_microbatches(suffixes, max_tokens - prefix):
            indices = [members[k] for k in chunk]
            out.append(Microbatch(indices, prefix if len(indices) > 1 else 0))
    if rest:
        lengths = [samples[i].length for i in rest]
        out.extend(Microbatch([rest[k] for k in b]) for b in pack_microbatches(lengths, max_tokens))
    return out

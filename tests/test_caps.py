"""Transition caps: a turn over max_turn_tokens is not trained, at most K trained turns per
trajectory (a seeded sample), dropped turns counted by cap, a member left with no trained turn
filtered as no_turns_in_cap — the pure functions against a plain reference, then the real
trainer on a real Redis, asserting on the batch its backend got."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch
from test_trainer_step import VOCAB, config_for, make_tiny_model, sampled_trajectory

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, Turn, decode, pack_logprobs, pack_tokens
from squall.trainer.caps import TURN_TOKENS, TURNS, TurnCaps, apply_caps, capped_flags
from squall.trainer.filters import decide_group
from squall.trainer.sequences import trajectory_to_samples

torch.set_num_threads(1)


def random_turns(rng: random.Random, n: int) -> list[Turn]:
    turns = []
    for _ in range(n):
        prompt, response = rng.randint(1, 40), rng.randint(1, 20)
        turns.append(Turn(
            model="policy", trained=rng.random() < 0.8, prompt_ids=pack_tokens([1] * prompt),
            response_ids=pack_tokens([2] * response), response_logprobs=pack_logprobs([-1.0] * response), version=0,
        ))  # fmt: skip
    return turns


def reference_flags(turns: list[Turn], max_tokens: int, k: int, chosen_from) -> tuple[list[bool], Counter]:
    """Plain reference: the token cap turn by turn, then keep k of the survivors (which k is
    given by `chosen_from`, the sample under test, checked separately)."""
    flags, counts = [], Counter()
    for t in turns:
        size = len(t.prompt_tokens) + len(t.response_tokens)
        over = bool(max_tokens) and t.trained and size > max_tokens
        counts[TURN_TOKENS] += over
        flags.append(t.trained and not over)
    survivors = [i for i, f in enumerate(flags) if f]
    if k and len(survivors) > k:
        kept = chosen_from(survivors)
        assert len(kept) == k and set(kept) <= set(survivors)
        for i in survivors:
            if i not in kept:
                flags[i] = False
                counts[TURNS] += 1
    return flags, +counts


def test_caps_match_the_reference_on_random_trajectories():
    rng = random.Random(0)
    for trial in range(500):
        turns = random_turns(rng, rng.randint(0, 12))
        caps = TurnCaps(rng.choice([0, 15, 30, 50]), rng.choice([0, 1, 2, 3, 5]), seed=rng.randint(0, 9))
        key = f"g{trial}:0#0"
        flags, counts = capped_flags(turns, caps, key)
        kept_now = {i for i, f in enumerate(flags) if f}
        expected, expected_counts = reference_flags(
            turns,
            caps.max_turn_tokens,
            caps.max_turns,
            lambda survivors, kept=kept_now: kept & set(survivors),
        )
        assert flags == expected and +counts == expected_counts
        assert capped_flags(turns, caps, key) == (flags, counts)  # the same on every replay


def test_the_turn_sample_is_uniform_and_depends_on_seed_and_key():
    turns = random_turns(random.Random(1), 6)
    turns = [msgspec.structs.replace(t, trained=True) for t in turns]
    caps = TurnCaps(max_turns=2, seed=3)
    picks = Counter()
    draws = set()
    for i in range(3000):
        flags, counts = capped_flags(turns, caps, f"g{i}:0#0")
        assert sum(flags) == 2 and counts == Counter({TURNS: 4})
        picks.update(j for j, f in enumerate(flags) if f)
        draws.add(tuple(flags))
    assert all(abs(c / 3000 - 2 / 6) < 0.04 for c in picks.values()), picks  # each turn ~1/3 of the time
    assert len(draws) == 15  # every pair of 6 turns occurs
    other = [capped_flags(turns, TurnCaps(max_turns=2, seed=4), f"g{i}:0#0")[0] for i in range(50)]
    assert other != [capped_flags(turns, caps, f"g{i}:0#0")[0] for i in range(50)]


def _member(model, index: int, reward: float, *, long_prompt: bool = False) -> Trajectory:
    """Four turns of one agent, each prompt extending the last (turn sizes 11, 19, 27, 35 tokens)."""
    traj = sampled_trajectory(model, "g", index, reward, seed=index, turns=4)
    if long_prompt:  # every turn 40 tokens longer: all over the cap
        pad = np.full(40, 5, np.int32)
        turns = [msgspec.structs.replace(t, prompt_ids=pack_tokens(np.concatenate([pad, t.prompt_tokens])))
                 for t in traj.turns]  # fmt: skip
        traj = msgspec.structs.replace(traj, turns=turns)
    return traj


def _masked_tokens(samples) -> list[int]:
    return [int(t) for s in samples for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m > 0]


@pytest.mark.slow
def test_a_group_built_to_exceed_each_cap(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(make_tiny_model(tmp_path / "m")))
    members = [_member(model, i, float(i % 2)) for i in range(3)] + [_member(model, 3, 1.0, long_prompt=True)]
    caps = TurnCaps(max_turn_tokens=30, max_turns=2, seed=0)
    decision = decide_group("g", members, trainer_version=0, max_staleness=1, overlong="mask",
                            max_seq_len=4096, caps=caps)  # fmt: skip
    assert [t.key for t in decision.filtered["no_turns_in_cap"]] == [members[3].key]
    assert len(decision.advantages) == 4  # the baseline still uses every ok reward
    # members 0-2: turn 3 (35 tokens) over the cap, then 2 of the other 3 kept; member 3: all 4 over
    assert decision.capped == Counter({TURN_TOKENS: 3 + 4, TURNS: 3})
    for original, capped in zip(members[:3], decision.train, strict=True):
        flags = [t.trained for t in capped.turns]
        assert sum(flags) == 2 and not flags[3]
        assert all(t.trained for t in original.turns)  # the input is not changed
        samples = trajectory_to_samples(capped, advantage=1.0)
        kept = [int(x) for t in capped.turns if t.trained for x in t.response_tokens]
        assert _masked_tokens(samples) == kept  # only the kept turns' responses are targets
        last = [t for t in capped.turns if t.trained][-1]  # kept turns merge into one sequence
        assert [s.length for s in samples] == [len(last.prompt_tokens) + len(last.response_tokens)]
    assert apply_caps(members[0], TurnCaps())[0] is members[0]  # caps off: untouched


@pytest.mark.redis
@pytest.mark.slow
def test_the_trainer_drops_counts_and_ledgers_capped_turns(tmp_path, r, redis_url, run_name):
    from test_trainer_loop import retag, run_until_step

    from squall.trainer.trainer import Trainer

    model_path = make_tiny_model(tmp_path / "model")
    config = config_for(
        tmp_path, model_path, groups_per_step=1, max_turn_tokens=30, max_turns_per_trajectory=2
    )
    config = config.model_copy(
        update={"run": config.run.model_copy(update={"name": run_name, "redis_url": redis_url})}
    )
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    batches: list = []
    real_step = trainer.backend.train_step

    def recording_step(samples):  # the real step, with the batch it was given kept for the test
        batches.append(list(samples))
        return real_step(samples)

    trainer.backend.train_step = recording_step
    model = trainer.backend.model
    members = [retag(_member(model, i, float(i % 2)), run_name) for i in range(3)]
    members.append(retag(_member(model, 3, 1.0, long_prompt=True), run_name))
    bus.publish_many(r, keys.trajectories, members)
    run_until_step(trainer, 1)

    ledger = Ledger(r, keys)
    assert [ledger.state_of(t.key) for t in members] == ["trained"] * 3 + ["filtered:no_turns_in_cap"]
    (batch,) = batches
    caps = TurnCaps(30, 2, config.run.seed)
    for member in members[:3]:
        flags, _ = capped_flags(member.turns, caps, member.key)
        kept = [int(x) for t, f in zip(member.turns, flags, strict=True) if f for x in t.response_tokens]
        assert _masked_tokens([s for s in batch if s.key == member.key]) == kept
    assert not [s for s in batch if s.key == members[3].key]
    (metrics,) = [decode(f[b"m"]) for _, f in r.xrange(keys.metrics)]
    assert metrics.values[TURN_TOKENS] == 7.0 and metrics.values[TURNS] == 3.0
    assert metrics.values["filtered:no_turns_in_cap"] == 1.0
    assert VOCAB > 5  # the padding token of the long prompts is in the vocabulary

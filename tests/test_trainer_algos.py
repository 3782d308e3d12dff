"""Trainer numerics: advantages vs a plain loop, the loss vs a hand computation, turns ->
sequences merging and masking, filters and group assembly. Pure functions, no I/O."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from squall.shared.schemas import Trajectory, Turn, pack_logprobs, pack_tokens
from squall.trainer.advantages import get_advantage_fn, grpo_advantages, rloo_advantages
from squall.trainer.filters import decide_group
from squall.trainer.group_assembly import GroupAssembler
from squall.trainer.losses import k3_kl, ppo_tis_loss
from squall.trainer.sequences import (
    OutOfVocab,
    check_vocab,
    collate,
    pack_microbatches,
    token_weights,
    trajectory_to_samples,
)


def turn(prompt, response, *, version=0, trained=True, finish="stop", agent="main", logprobs=None):
    lp = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return Turn(
        agent=agent, model="policy", trained=trained, prompt_ids=pack_tokens(prompt), response_ids=pack_tokens(response),
        response_logprobs=pack_logprobs(lp), version=version, finish_reason=finish,
    )  # fmt: skip


def traj(group, index, reward, turns=(), *, status="ok", attempt=0, size=4):
    return Trajectory(
        run="t", task_id=f"{group}:{index}", group_id=group, sample_id=group, index=index, group_size=size,
        attempt=attempt, runner_id="r", status=status, reward=reward if status == "ok" else None,
        turns=list(turns),
    )  # fmt: skip


# --- advantages -------------------------------------------------------------------
def reference_advantages(rewards, group_ids, kind):
    """Plain loop: per trajectory, the statistics of its group's trajectories."""
    out = []
    for i, g in enumerate(group_ids):
        members = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g]
        n = len(members)
        if n < 2:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / n)
        if kind == "grpo":
            out.append((rewards[i] - mean) / (std + 1e-6))
        elif kind == "drgrpo":
            out.append(rewards[i] - mean)
        else:
            out.append(rewards[i] - (sum(members) - rewards[i]) / (n - 1))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_advantages_match_loop_reference_and_ignore_turn_counts(seed, kind):
    rng = random.Random(seed)
    trajectories = []
    for g in range(rng.randint(1, 7)):
        size = rng.randint(1, 8)
        for i in range(size):
            n_turns = rng.randint(1, 6)  # varying turn counts must not move the baseline
            turns = [turn([1, 2, 3], [4, 5]) for _ in range(n_turns)]
            reward = rng.choice([0.0, 1.0, rng.uniform(-2, 2)])
            trajectories.append(traj(f"g{g}", i, reward, turns, size=size))
    rng.shuffle(trajectories)  # groups interleaved, as on the stream
    rewards = [t.reward for t in trajectories]
    groups = [t.group_id for t in trajectories]
    got = get_advantage_fn(kind)(rewards, groups)
    want = reference_advantages(rewards, groups, kind)
    assert np.allclose(got, want, atol=1e-9)
    # Every trained token of a trajectory carries exactly its trajectory's advantage.
    for t, a in zip(trajectories, got, strict=True):
        for s in trajectory_to_samples(t, advantage=a):
            assert s.advantage == a


def test_multi_turn_does_not_change_baseline():
    one_turn = [traj("g", 0, 1.0, [turn([1], [2])]), traj("g", 1, 0.0, [turn([1], [2])])]
    many_turns = [traj("g", 0, 1.0, [turn([1], [2])] * 9), traj("g", 1, 0.0, [turn([1], [2])])]
    a1 = grpo_advantages([t.reward for t in one_turn], ["g", "g"])
    a2 = grpo_advantages([t.reward for t in many_turns], ["g", "g"])
    assert a1 == a2 and a1[0] == pytest.approx(1.0, abs=1e-5) and a1[1] == pytest.approx(-1.0, abs=1e-5)


def test_group_of_one_gets_zero_and_unknown_name_lists_known():
    assert grpo_advantages([3.0], ["g"]) == [0.0]
    assert rloo_advantages([3.0, 1.0, 2.0], ["a", "b", "b"]) == [0.0, -1.0, 1.0]
    with pytest.raises(ValueError, match="drgrpo, grpo, rloo"):
        get_advantage_fn("ppo")


# --- loss -----------------------------------------------------------------------
def test_loss_matches_hand_computation():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -2.5, -0.2, -0.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights = mask / 3
    out = ppo_tis_loss(logp, behaviour, adv, mask, weights, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # token 0: r=1 -> -1; token 1: r=e^0.5=1.6487 -> A>0 clipped at 1.28 -> -1.28;
    # token 2: r=e^-0.3=0.7408, A<0: max(0.7408, clip 0.8) -> 0.8 (clipped)
    expected = (-1.0 - 1.28 + 0.8) / 3
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.clip_fraction == pytest.approx(2 / 3)
    assert out.tokens == 3
    out.loss.backward()
    # gradient flows only through the unclipped token 0: d/dlogp (-A r) = -r*A/3 = -1/3
    assert logp.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, 0.0, 0.0], abs=1e-6)


def test_tis_truncates_weight_but_keeps_gradient():
    # A<0 and r = e^2 = 7.39 > cap 2: value -A*cap, gradient weight cap (not zero).
    logp = torch.tensor([[0.0]], requires_grad=True)
    behaviour = torch.tensor([[-2.0]])
    out = ppo_tis_loss(logp, behaviour, torch.tensor([[-1.0]]), torch.ones(1, 1), torch.ones(1, 1),
                       clip_low=0.2, clip_high=0.28, tis_cap=2.0)  # fmt: skip
    assert out.loss.item() == pytest.approx(2.0)
    out.loss.backward()
    assert logp.grad.item() == pytest.approx(2.0)
    assert out.tis_fraction == 1.0


def test_k3_kl_is_zero_at_equality_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert torch.allclose(k3_kl(a, a), torch.zeros(2))
    assert (k3_kl(a, a - 0.5) > 0).all()
    # k3 = e^d - d - 1 with d = ref - logp
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.5])).item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


# --- turns -> sequences ---------------------------------------------------------------
def test_extending_turns_merge_with_observations_masked():
    t0 = turn([1, 2, 3], [10, 11], logprobs=[-0.1, -0.2])
    t1 = turn([1, 2, 3, 10, 11, 20, 21], [12, 13, 14], logprobs=[-0.3, -0.4, -0.5])
    samples = trajectory_to_samples(traj("g", 0, 1.0, [t0, t1]), advantage=0.5)
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 12, 13, 14]
    assert s.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert s.behaviour_logprobs.tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])


def test_non_extending_turn_starts_new_sample_and_counts_mismatch():
    from squall.trainer.sequences import SplitStats

    t0 = turn([1, 2], [10])
    t1 = turn([1, 9, 10, 20], [12])  # history rewritten (re-tokenised): no merge
    stats = SplitStats()
    samples = trajectory_to_samples(traj("g", 0, 1.0, [t0, t1]), advantage=-1.0, stats=stats)
    assert [s.input_ids.tolist() for s in samples] == [[1, 2, 10], [1, 9, 10, 20, 12]]
    assert all(s.advantage == -1.0 for s in samples)
    assert stats.mismatches == 1 and stats.merged_turns == 0


def test_untrained_and_truncated_turns():
    judge = turn([5, 6], [7], trained=False, version=-1)
    t0 = turn([1, 2], [10, 11], finish="length")
    samples = trajectory_to_samples(traj("g", 0, 1.0, [judge, t0]), mask_truncated=True)
    assert len(samples) == 1 and samples[0].input_ids.tolist() == [1, 2, 10, 11]
    assert samples[0].trained_tokens == 0
    kept = trajectory_to_samples(traj("g", 0, 1.0, [judge, t0]), mask_truncated=False)
    assert kept[0].loss_mask.tolist() == [0, 0, 1, 1]


def test_agents_keep_their_own_chains():
    a0 = turn([1], [2], agent="a")
    b0 = turn([7], [8], agent="b")
    a1 = turn([1, 2, 3], [4], agent="a")
    samples = trajectory_to_samples(traj("g", 0, 1.0, [a0, b0, a1]))
    assert sorted(s.input_ids.tolist() for s in samples) == [[1, 2, 3, 4], [7, 8]]


def test_out_of_vocab_is_detected():
    t = traj("g", 0, 1.0, [turn([1, 2], [500])])
    check_vocab(t, 501)
    with pytest.raises(OutOfVocab, match="500"):
        check_vocab(t, 500)


def test_weights_normalise_per_token_and_per_trajectory():
    long = trajectory_to_samples(traj("g", 0, 1.0, [turn([1], [2, 3, 4])]))
    short = trajectory_to_samples(traj("g", 1, 1.0, [turn([1], [2])]))
    samples = long + short
    tok = token_weights(samples, "token")
    assert [w.sum() for w in tok] == pytest.approx([0.75, 0.25])
    per_traj = token_weights(samples, "trajectory")
    assert [w.sum() for w in per_traj] == pytest.approx([0.5, 0.5])


def test_microbatches_respect_budget_and_collate_shifts():
    lengths = [10, 3, 7, 7, 2, 12]
    batches = pack_microbatches(lengths, 14)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 14
    samples = trajectory_to_samples(traj("g", 0, 1.0, [turn([1, 2], [3])]), advantage=2.0)
    arrays = collate(samples, token_weights(samples, "token"), pad_id=0)
    assert arrays["targets"].tolist() == [[2, 3]]
    assert arrays["loss_mask"].tolist() == [[0, 1]]
    assert arrays["advantages"].tolist() == [[2.0, 2.0]]  # the row carries its trajectory value


# --- filters and groups ------------------------------------------------------------------
def test_filters_by_reason():
    members = [
        traj("g", 0, 1.0, [turn([1], [2], version=5)]),
        traj("g", 1, 0.0, [turn([1], [2], version=5)]),
        traj("g", 2, 1.0, [turn([1], [2], version=2)]),  # stale at trainer version 5
        traj("g", 3, None, status="timeout"),
        traj("g", 4, 0.0, [turn([1], [2], version=5, finish="length")]),
        traj("g", 5, 0.0, [turn(list(range(40)), [2], version=5)]),  # over max_seq_len
    ]
    d = decide_group("g", members, trainer_version=5, max_staleness=1, overlong="drop", max_seq_len=32)
    assert [t.index for t in d.train] == [0, 1]
    assert {k: [t.index for t in v] for k, v in d.filtered.items()} == {
        "timeout": [3],
        "stale": [2],
        "overlong": [4, 5],
    }
    # baseline over all 5 ok members (stale/truncated included)
    assert d.advantages[members[0].key] == pytest.approx(grpo_advantages([1, 0, 1, 0, 0], ["g"] * 5)[0])
    same = [traj("h", i, 1.0, [turn([1], [2])]) for i in range(3)]
    z = decide_group("h", same, trainer_version=0, max_staleness=1, overlong="mask", max_seq_len=32)
    assert not z.train and len(z.filtered["zero_variance"]) == 3


def test_groups_complete_by_members_or_deadline_and_late_members():
    asm = GroupAssembler(group_wait_s=10.0, max_attempts=2)
    asm.add("1-0", traj("g", 0, 1.0, size=2), now=0.0)
    asm.add("1-1", traj("g", 1, None, status="failed", attempt=0, size=2), now=0.0)
    assert asm.pop_complete(now=1.0) == []  # the failed member will be retried
    asm.add("1-2", traj("g", 1, 0.0, attempt=1, size=2), now=1.0)
    done = asm.pop_complete(now=1.0)
    assert len(done) == 1 and len(done[0].members) == 3 and not done[0].timed_out
    assert asm.add("1-3", traj("g", 1, 0.0, attempt=2, size=2)) == "late"
    asm.add("2-0", traj("h", 0, 1.0, size=3), now=5.0)
    assert asm.pop_complete(now=14.0) == []
    timed = asm.pop_complete(now=15.0)
    assert len(timed) == 1 and timed[0].timed_out

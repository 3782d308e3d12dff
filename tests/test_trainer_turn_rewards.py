"""Turn-level rewards in the trainer: the estimators against a plain loop, one final reward
equal to today's trajectory-level result bit for bit, rewards per turn, and per-token
advantages through samples and the collated batch. Pure functions, no I/O."""

from __future__ import annotations

import random

import numpy as np
import pytest

from squall.shared.schemas import Trajectory, Turn, pack_logprobs, pack_tokens
from squall.trainer.advantages import get_advantage_fn, turn_advantages, turn_returns
from squall.trainer.filters import decide_group, rewards_per_turn
from squall.trainer.sequences import collate, token_weights, trajectory_to_samples


def turn(prompt, response, *, reward=None, trained=True, agent="main"):
    return Turn(
        agent=agent, model="policy", trained=trained, prompt_ids=pack_tokens(prompt),
        response_ids=pack_tokens(response), response_logprobs=pack_logprobs([-0.5] * len(response)),
        version=0, reward=reward,
    )  # fmt: skip


def traj(group, index, reward, turns):
    return Trajectory(
        run="t", task_id=f"{group}:{index}", group_id=group, sample_id=group, index=index, group_size=4,
        attempt=0, runner_id="r", status="ok", reward=reward, turns=list(turns),
    )  # fmt: skip


def reference(turn_rewards, group_ids, base, gamma, eps=1e-6):
    """Plain loops: return-to-go per turn, baseline from the group's whole-trajectory returns."""
    returns = []
    for rewards in turn_rewards:
        g = []
        for k in range(len(rewards)):
            g.append(sum(gamma ** (j - k) * rewards[j] for j in range(k, len(rewards))))
        returns.append(g)
    whole = [g[0] if g else 0.0 for g in returns]
    out = []
    for i, gid in enumerate(group_ids):
        others = [whole[j] for j in range(len(whole)) if group_ids[j] == gid and j != i]
        members = [whole[j] for j in range(len(whole)) if group_ids[j] == gid]
        if not others:
            out.append([0.0] * len(returns[i]))
            continue
        mean = sum(members) / len(members)
        if base == "rloo":
            b, s = sum(others) / len(others), 1.0
        elif base == "drgrpo":
            b, s = mean, 1.0
        else:
            b = mean
            s = (sum((x - mean) ** 2 for x in members) / len(members)) ** 0.5 + eps
        out.append([(g - b) / s for g in returns[i]])
    return out


@pytest.mark.parametrize("base", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_turn_estimator_matches_plain_loop(base, gamma):
    rng = random.Random(f"{base}{gamma}")
    for _ in range(30):
        n = rng.randint(1, 12)
        groups = [f"g{rng.randint(0, 3)}" for _ in range(n)]
        rewards = [
            [rng.choice([0.0, 0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(rng.randint(0, 6))]
            for _ in range(n)
        ]
        got = turn_advantages(rewards, groups, base=base, gamma=gamma)
        want = reference(rewards, groups, base, gamma)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def test_turn_returns_discount():
    np.testing.assert_allclose(turn_returns([1.0, 0.0, 2.0], 0.5), [1.0 + 0.5, 1.0, 2.0])


@pytest.mark.parametrize("base", ["grpo", "drgrpo", "rloo"])
def test_one_final_reward_equals_the_trajectory_estimator_exactly(base):
    rng = random.Random(base)
    for _ in range(30):
        n = rng.randint(2, 10)
        groups = [f"g{rng.randint(0, 2)}" for _ in range(n)]
        finals = [rng.uniform(-3, 3) for _ in range(n)]
        lengths = [rng.randint(1, 5) for _ in range(n)]
        per_turn = [[0.0] * (k - 1) + [r] for k, r in zip(lengths, finals, strict=True)]
        got = turn_advantages(per_turn, groups, base=base, gamma=1.0)
        today = get_advantage_fn(base)(finals, groups)
        for adv, k, want in zip(got, lengths, today, strict=True):
            assert adv == [want] * k  # exact, not approximately


def test_rewards_per_turn_places_emitted_and_outcome():
    t = [turn([1], [2], reward=0.25), turn([1, 2, 3], [4]), turn([1, 2, 3, 4, 5], [6], reward=0.5)]
    # reward 2.0 = 0.25 + 0.5 emitted + 1.25 returned (outcome, on the last turn)
    assert rewards_per_turn(traj("g", 0, 2.0, t)) == [0.25, 0.0, 1.75]
    only_outcome = [turn([1], [2]), turn([1, 2, 3], [4])]
    assert rewards_per_turn(traj("g", 0, 1.0, only_outcome)) == [0.0, 1.0]
    assert rewards_per_turn(traj("g", 0, 0.7, [])) == [0.7]
    one_emit = [turn([1], [2]), turn([1, 2, 3], [4], reward=0.3)]
    assert rewards_per_turn(traj("g", 0, 0.3, one_emit)) == [0.0, 0.3]


def test_decide_group_with_one_reward_matches_today_and_turns_differ_with_several():
    members = [
        traj("g", i, r, [turn([1], [2]), turn([1, 2, 3], [4], reward=r)])
        for i, r in enumerate([0.0, 1.0, 0.5])
    ]
    kw = dict(trainer_version=0, max_staleness=1, overlong="keep", max_seq_len=100)
    today = decide_group("g", members, advantage="rloo", **kw)
    turned = decide_group("g", members, advantage="turn_rloo", **kw)
    assert turned.advantages == today.advantages
    assert turned.turn_advantages == {k: [a, a] for k, a in today.advantages.items()}
    # A reward after the first call reaches the first turn only.
    early = [
        traj("g", i, r, [turn([1], [2], reward=r), turn([1, 2, 3], [4])]) for i, r in enumerate([0.0, 1.0])
    ]
    d = decide_group("g", early, advantage="turn_rloo", **kw)
    assert d.turn_advantages["g:1#0"] == [1.0, 0.0]
    assert d.turn_advantages["g:0#0"] == [-1.0, -1.0]  # its returns 0, 0 against the other's 1


def test_each_token_carries_its_own_turns_advantage_into_the_batch():
    t = traj("g", 0, 1.0, [turn([1, 2], [3, 4]), turn([1, 2, 3, 4, 9], [5, 6, 7])])
    (sample,) = trajectory_to_samples(t, advantage=0.0, turn_advantages=[0.5, -2.0])
    # ids 1 2 | 3 4 | 9 | 5 6 7 ; mask 0 0 1 1 0 1 1 1
    np.testing.assert_array_equal(sample.loss_mask, [0, 0, 1, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(sample.advantages[sample.loss_mask > 0], [0.5, 0.5, -2.0, -2.0, -2.0])
    arrays = collate([sample], token_weights([sample], "token"))
    np.testing.assert_array_equal(
        arrays["advantages"][0][arrays["loss_mask"][0] > 0], [0.5, 0.5, -2.0, -2.0, -2.0]
    )
    with pytest.raises(ValueError, match="2 turns"):
        trajectory_to_samples(t, turn_advantages=[1.0])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown turn advantage base 'ppo'"):
        turn_advantages([[1.0]], ["g"], base="ppo")
    with pytest.raises(ValueError, match="gamma"):
        turn_advantages([[1.0]], ["g"], gamma=0.0)
    with pytest.raises(ValueError, match="NaN"):
        turn_advantages([[1.0], [float("nan")]], ["g", "g"])


@pytest.mark.redis
@pytest.mark.slow
def test_a_trainer_run_trains_on_turn_rewards(tmp_path, r, redis_url, run_name):
    """Trajectories whose turns carry rewards go through a real trainer with turn_rloo: the
    step's advantages are the per-turn ones (first turn: the whole return minus the others')."""

    import msgspec
    import torch
    from test_trainer_loop import run_until_step
    from test_trainer_step import config_for, make_tiny_model, sampled_trajectory

    from squall.shared import bus
    from squall.shared.keys import GROUP_TRAINER, Keys
    from squall.shared.ledger import Ledger
    from squall.shared.schemas import decode
    from squall.trainer.trainer import Trainer

    torch.set_num_threads(1)
    config = config_for(
        tmp_path, make_tiny_model(tmp_path / "model"), groups_per_step=1, advantage="turn_rloo"
    )
    config = config.model_copy(
        update={"run": config.run.model_copy(update={"name": run_name, "redis_url": redis_url})}
    )
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    group = []
    for i, (first, last) in enumerate([(1.0, 0.0), (0.0, 0.0), (0.0, 2.0), (1.0, 1.0)]):
        t = sampled_trajectory(trainer.backend.model, "a", i, first + last, seed=i, turns=2)
        turns = [msgspec.structs.replace(t.turns[0], reward=first), t.turns[1]]  # `last` is the outcome
        group.append(msgspec.structs.replace(t, run=run_name, turns=turns))
    bus.publish_many(r, keys.trajectories, group)
    run_until_step(trainer, 1)
    assert {Ledger(r, keys).state_of(t.key) for t in group} == {"trained"}
    (metrics,) = [decode(f[b"m"]).values for _, f in r.xrange(keys.metrics)]
    want = turn_advantages([[1.0, 0.0], [0.0, 0.0], [0.0, 2.0], [1.0, 1.0]], ["a"] * 4)
    first_turns = np.asarray([a[0] for a in want])
    assert metrics["advantage_mean"] == pytest.approx(first_turns.mean())
    assert metrics["advantage_abs_max"] == pytest.approx(np.abs(first_turns).max())
    assert want[0] == [1.0 - 4.0 / 3, 0.0 - 4.0 / 3]  # the second turn does not get the first's reward

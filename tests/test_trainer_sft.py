"""SFT from traces: which members train (threshold, dedup, zero-variance groups), which tokens
carry the loss (only the sampled tokens of trained agents), the loss itself (the NLL of those
tokens), and a trainer run on a real Redis and a tiny model where every member is trained or
consumed exactly once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_trainer_loop import retag, run_until_step
from test_trainer_step import config_for, make_tiny_model, sampled_trajectory

from squall.shared import bus
from squall.shared.keys import GROUP_TRAINER, Keys
from squall.shared.ledger import Ledger
from squall.shared.schemas import Trajectory, Turn, decode, pack_logprobs, pack_tokens
from squall.trainer.backend import make_backend
from squall.trainer.filters import decide_group
from squall.trainer.losses import ppo_tis_loss
from squall.trainer.sequences import collate, token_weights
from squall.trainer.sft import SftSelector, sft_samples
from squall.trainer.trainer import Trainer


def turn(prompt, response, *, trained=True, agent="main"):
    return Turn(
        agent=agent, model="policy", trained=trained, prompt_ids=pack_tokens(prompt),
        response_ids=pack_tokens(response), response_logprobs=pack_logprobs([-1.0] * len(response)), version=0,
    )  # fmt: skip


def traj(group, index, reward, turns, run="t"):
    return Trajectory(
        run=run, task_id=f"{group}:{index}", group_id=group, sample_id=group, index=index, group_size=4,
        attempt=0, runner_id="r", status="ok", reward=reward, turns=list(turns),
    )  # fmt: skip


KW = dict(trainer_version=0, max_staleness=1, overlong="keep", max_seq_len=1000)


def decide(members, selector):
    return selector.mark(decide_group("g", members, keep_zero_variance=True, **KW))


def test_only_sampled_tokens_of_trained_agents_carry_the_sft_loss():
    t = traj("g", 0, 1.0, [
        turn([1, 2], [3, 4]),  # trained: prompt 1 2, sampled 3 4
        turn([7, 7], [8, 8, 8], trained=False, agent="judge"),  # a frozen agent: never in the loss
        turn([1, 2, 3, 4, 5, 6], [9]),  # tool output 5 6, sampled 9
    ])  # fmt: skip
    (sample,) = sft_samples(t, mask_truncated=False)
    assert sample.sft
    np.testing.assert_array_equal(sample.input_ids, [1, 2, 3, 4, 5, 6, 9])
    np.testing.assert_array_equal(sample.loss_mask, [0, 0, 1, 1, 0, 0, 1])
    arrays = collate([sample], token_weights([sample], "token"))
    np.testing.assert_array_equal(arrays["sft_mask"][0], [0, 1, 1, 0, 0, 1])  # targets 2 3 4 5 6 9
    assert 8 not in sample.input_ids.tolist()


def test_the_sft_loss_is_the_mean_nll_of_the_sampled_tokens():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=gen) * 3
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    weights = mask / mask.sum()
    out = ppo_tis_loss(
        logp, torch.zeros_like(logp), torch.zeros_like(logp), mask, weights,
        clip_low=0.2, clip_high=0.28, tis_cap=2.0, sft_mask=mask, sft_coef=0.5,
    )  # fmt: skip
    want = -0.5 * float(logp[mask > 0].mean())
    assert float(out.loss) == pytest.approx(want, rel=1e-6)


def test_threshold_and_only_mode_filter_the_rest():
    members = [traj("g", i, r, [turn([1, 2], [3, i + 10])]) for i, r in enumerate([1.0, 0.5, 0.0, 1.0])]
    d = decide(members, SftSelector("only", threshold=0.75))
    assert d.sft == {"g:0#0", "g:3#0"} and [t.key for t in d.train] == ["g:0#0", "g:3#0"]
    assert d.advantages == {}  # SFT alone: no policy-gradient term
    assert sorted(t.key for t in d.filtered["sft_below_threshold"]) == ["g:1#0", "g:2#0"]


def test_zero_variance_groups_train_by_sft_and_mix_keeps_grpo():
    all_good = [traj("g", i, 1.0, [turn([1, 2], [3, i + 10])]) for i in range(4)]
    d = decide(all_good, SftSelector("mix", threshold=1.0))
    assert len(d.sft) == 4 and d.advantages == {}  # no GRPO signal, still SFT
    mixed = [traj("g", i, float(i % 2), [turn([1, 2], [3, i + 20])]) for i in range(4)]
    d = decide(mixed, SftSelector("mix", threshold=1.0))
    assert d.sft == {"g:1#0", "g:3#0"} and len(d.advantages) == 4 and len(d.train) == 4


def test_dedup_keeps_the_first_copy_of_the_same_trained_tokens():
    selector = SftSelector("only", threshold=1.0)
    same = [
        traj("g", i, 1.0, [turn([1, 2], [3, 4]), turn([9], [5], trained=False, agent=f"other{i}")])
        for i in range(3)
    ]
    d = decide(same, selector)  # untrained turns differ, trained tokens are equal: duplicates
    assert d.sft == {"g:0#0"}
    assert sorted(t.key for t in d.filtered["sft_duplicate"]) == ["g:1#0", "g:2#0"]
    again = decide([traj("g", 7, 1.0, [turn([1, 2], [3, 4])])], selector)  # a later group: still seen
    assert again.sft == set() and [t.key for t in again.filtered["sft_duplicate"]] == ["g:7#0"]


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="unknown trainer.sft mode 'dpo': known are off, only, mix"):
        SftSelector("dpo")


def test_sft_step_raises_the_likelihood_of_the_sampled_tokens(tmp_path):
    model_path = make_tiny_model(tmp_path / "model")
    backend = make_backend("torch", config_for(tmp_path, model_path, sft="only"))
    samples = [
        s
        for i in range(2)
        for s in sft_samples(
            sampled_trajectory(backend.model, "g", i, 1.0, seed=i, turns=2), mask_truncated=False
        )
    ]
    before = backend.loss_on(samples)
    backend.train_step(samples)
    after = backend.loss_on(samples)
    assert after < before, (before, after)


@pytest.mark.redis
@pytest.mark.slow
def test_sft_run_trains_or_consumes_every_member_once(tmp_path, r, redis_url, run_name):
    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    config = config_for(
        tmp_path, model_path, groups_per_step=1, group_wait_s=30.0, sft="only", sft_threshold=1.0
    )
    config = config.model_copy(
        update={"run": config.run.model_copy(update={"name": run_name, "redis_url": redis_url})}
    )
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    trainer = Trainer(config)
    model = trainer.backend.model
    good = [sampled_trajectory(model, "a", i, 1.0, seed=i) for i in range(4)]  # a zero-variance group
    good[3] = Trajectory(
        **{**{f: getattr(good[0], f) for f in good[0].__struct_fields__}, "task_id": "a:3", "index": 3}
    )
    half = [sampled_trajectory(model, "b", i, float(i % 2), seed=10 + i) for i in range(4)]
    bus.publish_many(r, keys.trajectories, [retag(t, run_name) for t in good + half])
    run_until_step(trainer, 2)
    ledger = Ledger(r, keys)
    states = {t.key: ledger.state_of(t.key) for t in good + half}
    assert states == {
        "a:0#0": "trained", "a:1#0": "trained", "a:2#0": "trained", "a:3#0": "filtered:sft_duplicate",
        "b:0#0": "filtered:sft_below_threshold", "b:1#0": "trained",
        "b:2#0": "filtered:sft_below_threshold", "b:3#0": "trained",
    }  # fmt: skip
    assert r.xpending(keys.trajectories, GROUP_TRAINER)["pending"] == 0
    metrics = [decode(f[b"m"]).values for _, f in r.xrange(keys.metrics)]
    assert [m["sft_samples"] for m in metrics] == [3.0, 2.0]

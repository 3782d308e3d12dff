"""verl backend: the batch layout (no verl needed), and real steps of verl 0.9's FSDP2 training
engine on the tiny model when verl is installed (marked verl; on a GPU marked gpu)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from optional import need_verl
from test_trainer_step import config_for, make_tiny_model, sampled_trajectory, step_batch

from squall.trainer.sequences import trajectory_to_samples
from squall.trainer.verl_backend import to_verl_batch

torch.set_num_threads(1)


def test_verl_layout_left_pads_prompts_and_masks_observations():
    from test_trainer_algos import traj, turn

    t0 = turn([1, 2, 3], [10, 11], logprobs=[-0.1, -0.2])
    t1 = turn([1, 2, 3, 10, 11, 20], [12], logprobs=[-0.3])
    merged = trajectory_to_samples(traj("g", 0, 1.0, [t0, t1]), advantage=0.5)[0]
    short = trajectory_to_samples(
        traj("g", 1, 0.0, [turn([7], [8, 9], logprobs=[-1.0, -2.0])]), advantage=-0.5
    )[0]
    b = to_verl_batch([merged, short], pad_id=0)
    # prompt width 3 (merged), response width 4 (10 11 20 12)
    assert b["input_ids"].tolist() == [[1, 2, 3, 10, 11, 20, 12], [0, 0, 7, 8, 9, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 7, [0, 0, 1, 1, 1, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 2, 2]]
    assert b["responses"].tolist() == [[10, 11, 20, 12], [8, 9, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 0, 0]]
    assert torch.allclose(b["old_log_probs"], torch.tensor([[-0.1, -0.2, 0, -0.3], [-1.0, -2.0, 0, 0]]))
    assert b["advantages"].tolist() == [[0.5, 0.5, 0, 0.5], [-0.5, -0.5, 0, 0]]


@pytest.mark.verl
@pytest.mark.slow
def test_verl_update_policy_step_matches_torch_and_lowers_loss(tmp_path):
    need_verl()
    from squall.trainer.backend import make_backend

    model_path = make_tiny_model(tmp_path / "model")
    config = config_for(tmp_path, model_path, max_tokens_per_microbatch=64)
    verl_backend = make_backend("verl", config)
    torch_backend = make_backend("torch", config)
    samples = []
    for i, adv in enumerate([1.0, -1.0, 1.0, -1.0]):
        t = sampled_trajectory(torch_backend.model, "g", i, 1.0 if adv > 0 else 0.0, seed=i, turns=2)
        samples += trajectory_to_samples(t, advantage=adv)
    before = torch_backend.loss_on(samples)
    got = verl_backend.train_step(samples)
    want = torch_backend.train_step(samples)
    # same model, behaviour = own logprobs: ratio ~1, pg loss ~ -mean advantage per token
    # (verl splits the batch into its own micro-batches: sums in another order)
    assert got["pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-2)
    assert got["tokens"] == want["tokens"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.1)
    torch_backend.model.load_state_dict(verl_backend.weights())
    assert torch_backend.loss_on(samples) < before


@pytest.mark.verl
@pytest.mark.gpu
def test_verl_fsdp_step_on_gpu(tmp_path):
    need_verl()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from squall.trainer.backend import make_backend

    model_path = make_tiny_model(tmp_path / "model")
    backend = make_backend("verl", config_for(tmp_path, model_path, device="cuda"))
    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(model_path)  # a CPU copy: FSDP owns the GPU one
    samples = []
    for i, adv in enumerate([1.0, -1.0]):
        samples += trajectory_to_samples(
            sampled_trajectory(sampler, "g", i, adv, seed=i, turns=2), advantage=adv
        )
    metrics = backend.train_step(samples)
    assert metrics["tokens"] > 0 and metrics["grad_norm"] > 0
    assert abs(metrics["ratio_mean"] - 1.0) < 0.05  # bf16 forward vs fp32 sampler
    weights = backend.weights()
    assert set(weights) >= {k for k, _ in sampler.named_parameters()}
    backend.save_state(tmp_path / "state.pt")
    backend.load_state(tmp_path / "state.pt")


def far_ratio_inputs(seed: int, shape=(6, 40)):
    """logp and behaviour logprobs up to e^3 apart (ratios from ~0.05 to ~20), advantages of
    both signs, a loss mask with holes. All (B, T)."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(shape, generator=gen) * 4
    behaviour = logp + (torch.rand(shape, generator=gen) * 6 - 3)
    adv = torch.randn(shape[0], 1, generator=gen).expand(shape).clone()
    mask = (torch.rand(shape, generator=gen) > 0.2).float()
    return logp, behaviour, adv, mask


@pytest.mark.verl
@pytest.mark.parametrize("seed", range(4))
def test_verl_dual_clip_and_tis_differ_only_past_the_cap_for_negative_advantages(seed):
    """verl's vanilla loss (dual clip, clip_ratio_c = c) and squall's TIS (tis_cap = c) have the
    same value everywhere; their gradients differ only where A < 0 and ratio > c: there
    dual clip makes the term the constant -A*c (gradient 0), TIS keeps -A*c*grad(logp)."""
    need_verl()
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    from squall.trainer.losses import ppo_tis_token_loss

    logp, behaviour, adv, mask = far_ratio_inputs(seed)
    cap, low, high = 2.0, 0.2, 0.28
    ratio = torch.exp(logp - behaviour)
    assert (ratio > 10).any() and (ratio < 0.1).any() and (adv < 0).any() and (adv > 0).any()

    def per_token(fn):
        x = logp.clone().requires_grad_(True)
        values = fn(x)
        values.sum().backward()
        return values.detach(), x.grad

    def verl_terms(x):  # seq-mean-token-sum over one-token "sequences" = every term on its own
        flat = lambda t: t.reshape(-1, 1)  # noqa: E731
        config = OmegaConf.create({"clip_ratio": low, "clip_ratio_low": low, "clip_ratio_high": high,
                                   "clip_ratio_c": cap, "global_batch_info": {}})  # fmt: skip
        loss, _ = compute_policy_loss_vanilla(flat(behaviour), flat(x), flat(adv), torch.ones_like(flat(x)),
                                              loss_agg_mode="seq-mean-token-sum", config=config)  # fmt: skip
        return loss * x.numel()  # back from the mean; its gradient is per token

    squall_values, squall_grad = per_token(
        lambda x: ppo_tis_token_loss(x, behaviour, adv, clip_low=low, clip_high=high, tis_cap=cap)[0]
    )
    verl_total, verl_grad = per_token(verl_terms)
    assert verl_total.item() == pytest.approx(squall_values.sum().item(), rel=1e-5)
    differs = (adv < 0) & (ratio > cap)
    assert differs.any() and (~differs).any()
    assert torch.allclose(squall_grad[~differs], verl_grad[~differs], atol=1e-6)
    assert torch.equal(verl_grad[differs], torch.zeros(int(differs.sum())))
    assert torch.allclose(squall_grad[differs], (-adv * cap)[differs], atol=1e-6)


@pytest.mark.verl
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_the_registered_verl_policy_loss_is_squalls(loss_agg_mode):
    """The verl backend's loss mode computes squall's loss: value and gradient equal to
    ppo_tis_loss with the matching normalisation, at ratios far from 1."""
    need_verl()
    from omegaconf import OmegaConf

    from squall.trainer.losses import ppo_tis_loss
    from squall.trainer.verl_backend import squall_policy_loss

    logp, behaviour, adv, mask = far_ratio_inputs(7)
    config = OmegaConf.create({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0})
    if loss_agg_mode == "token-mean":
        weights = mask / mask.sum()
    else:
        weights = mask / mask.sum(-1, keepdim=True) / mask.shape[0]
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    got, metrics = squall_policy_loss(behaviour, x, adv, mask, loss_agg_mode, config)
    clipfrac, tisfrac = metrics["actor/pg_clipfrac"], metrics["actor/pg_clipfrac_lower"]
    want = ppo_tis_loss(y, behaviour, adv, mask, weights, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    got.backward()
    want.loss.backward()
    assert got.item() == pytest.approx(want.loss.item(), rel=1e-5)
    assert torch.allclose(x.grad, y.grad, atol=1e-7)
    assert clipfrac == pytest.approx(want.clip_fraction, rel=1e-5)
    assert tisfrac == pytest.approx(want.tis_fraction, rel=1e-5) and want.tis_fraction > 0


@pytest.mark.verl
@pytest.mark.slow
def test_verl_step_matches_torch_far_from_ratio_one(tmp_path):
    """Behaviour logprobs far from the model's (ratios e^-2.5 .. e^2.5, both advantage signs):
    the verl backend's step equals the torch backend's, and verl's own dual clip would not."""
    need_verl()
    from squall.trainer.backend import make_backend
    from squall.trainer.verl_backend import verl_actor_config

    model_path = make_tiny_model(tmp_path / "model")
    config = config_for(tmp_path, model_path, max_tokens_per_microbatch=64)
    torch_backend = make_backend("torch", config)
    samples = []
    gen = np.random.default_rng(0)
    for i, adv in enumerate([1.0, -1.0, 1.0, -1.0]):
        t = sampled_trajectory(torch_backend.model, "g", i, 1.0 if adv > 0 else 0.0, seed=i, turns=2)
        for s in trajectory_to_samples(t, advantage=adv):
            shift = gen.uniform(1.0, 2.5, s.length) * gen.choice([-1.0, 1.0], s.length)
            s.behaviour_logprobs = (s.behaviour_logprobs + shift * s.loss_mask).astype(np.float32)
            samples.append(s)
    want = torch_backend.train_step(samples)
    assert want["tis_fraction"] > 0.1 and want["clip_fraction"] > 0.1
    got = make_backend("verl", config).train_step(samples)
    # verl splits the batch into its own micro-batches: sums in another order
    assert got["pg_loss"] == pytest.approx(want["pg_loss"], abs=2e-2)
    assert got["tis_fraction"] == pytest.approx(want["tis_fraction"], abs=0.05)
    assert got["clip_fraction"] == pytest.approx(want["clip_fraction"], abs=0.05)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.1)
    vanilla = make_backend("verl", config)
    vanilla.actor_config = verl_actor_config(
        config.trainer, loss_mode="vanilla"
    )  # verl's dual clip at c = tis_cap
    dual = vanilla.train_step(samples)
    assert dual["pg_loss"] == pytest.approx(want["pg_loss"], abs=2e-2)  # same value ...
    assert abs(dual["grad_norm"] - want["grad_norm"]) > 0.2 * want["grad_norm"]  # ... other gradient


def verl_train_once(tmp_dir, model_path, samples, trainer):
    """One verl step on a fresh backend (in a run_world rank): (metrics, full weights on rank 0)."""
    from squall.trainer.backend import make_backend

    backend = make_backend("verl", config_for(Path(tmp_dir), model_path, **trainer))
    return backend.train_step(samples), backend.weights()


@pytest.mark.verl
@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer",
    [{"loss_agg": "token"}, {"loss_agg": "trajectory", "kl_coef": 0.1}],
    ids=["token", "trajectory+kl"],
)
def test_verl_two_ranks_step_equals_one_process(tmp_path, trainer):
    """verl's engine sharding the model over 2 gloo ranks (FSDP2), each training on its share of
    the step, gives the weights and metrics of the same step in one process."""
    need_verl()
    from distributed_helpers import run_world

    model_path = make_tiny_model(tmp_path / "model")
    samples = step_batch(model_path)
    trainer = {**trainer, "max_tokens_per_microbatch": 40}
    [(single_metrics, single_weights)] = run_world(
        verl_train_once, str(tmp_path / "single"), str(model_path), samples, trainer, world_size=1
    )
    (metrics0, weights0), (metrics1, weights1) = run_world(
        verl_train_once, str(tmp_path / "ranks"), str(model_path), samples, trainer
    )
    assert weights1 == {}  # gathered to rank 0 only
    from safetensors.torch import load_file

    before = load_file(str(model_path / "model.safetensors"))
    moved = max(float((single_weights[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the step changed the weights: the comparison below means something
    # The whole model within 1e-5 relative (in norm, not entry by entry): verl packs each rank's
    # micro-batches its own way, so the gradient is summed in another order (its norm agrees to
    # 1e-7), and Adam's first step, g / (|g| + eps), turns that rounding into up to 7e-5 in the
    # few entries whose gradient is near zero (measured: 6 of 26912 entries; whole model 5e-6).
    assert single_weights.keys() == weights0.keys()
    off = sum(float(torch.linalg.norm(weights0[k] - w)) ** 2 for k, w in single_weights.items()) ** 0.5
    size = sum(float(torch.linalg.norm(w)) ** 2 for w in single_weights.values()) ** 0.5
    update = sum(float(torch.linalg.norm(single_weights[k] - w)) ** 2 for k, w in before.items()) ** 0.5
    assert off <= 1e-5 * size and off <= 1e-3 * update, (off, size, update)
    for metrics in (metrics0, metrics1):  # every rank reports the whole step
        assert metrics.keys() == single_metrics.keys()
        for name, value in single_metrics.items():
            if name != "microbatches":  # verl chooses its own split per rank
                assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.verl
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize(
    "launch", [("--nproc-per-node", "2"), ("--ray", "--workers", "2")], ids=["torchrun", "ray"]
)
def test_verl_trainer_on_two_ranks_publishes_the_one_process_step(tmp_path, r, redis_url, run_name, launch):
    """The whole trainer with the verl backend, its ranks started by torchrun or by Ray Train,
    publishes the weights of the same first step taken by one process (the model's norm)."""
    need_verl()
    from test_trainer_ray import one_step, published_weights

    model_path = make_tiny_model(tmp_path / "model")
    single = one_step(tmp_path / "single", r, redis_url, run_name, model_path, "--backend", "verl")
    ranks = one_step(
        tmp_path / "ranks", r, redis_url, f"{run_name}x", model_path, "--backend", "verl", *launch
    )
    want, got = published_weights(single, 1), published_weights(ranks, 1)
    assert list(ranks.glob("checkpoints/**/rng-00001.pt"))  # two ranks each saved their part
    assert want.keys() == got.keys()
    off = sum(float(torch.linalg.norm(got[k] - w)) ** 2 for k, w in want.items()) ** 0.5
    size = sum(float(torch.linalg.norm(w)) ** 2 for w in want.values()) ** 0.5
    assert off <= 1e-5 * size, (off, size)
    from safetensors.torch import load_file

    before = load_file(str(model_path / "model.safetensors"))
    assert max(float((want[k] - before[k]).abs().max()) for k in before) > 1e-5  # the step moved them

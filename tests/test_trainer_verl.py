"""verl backend: the DataProto layout (no verl needed), and a real update_policy step on the
tiny model when verl is installed (marked verl; FSDP on a GPU marked gpu)."""

from __future__ import annotations

import pytest
import torch
from squall.trainer.sequences import trajectory_to_samples
from squall.trainer.verl_backend import to_verl_batch
from test_trainer_step import config_for, make_tiny_model, sampled_trajectory

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
    pytest.importorskip("verl")
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
    # (verl runs its forward under bf16 autocast even on CPU, hence the tolerances)
    assert got["pg_loss"] == pytest.approx(want["pg_loss"], abs=1e-2)
    assert got["tokens"] == want["tokens"] and got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.1)
    verl_backend.model.eval()
    torch_backend.model.load_state_dict(verl_backend.model.state_dict())
    assert torch_backend.loss_on(samples) < before


@pytest.mark.verl
@pytest.mark.gpu
def test_verl_fsdp_step_on_gpu(tmp_path):
    pytest.importorskip("verl")
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

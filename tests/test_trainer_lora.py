"""LoRA training on the real calc policy: only adapters train, the base stays bit-identical,
the KL reference is the base; the published adapter is small, verifies by its checksum, and a
fresh torch inference engine merging it gives the trainer's logits (a second version replaces
the first, never stacks) and `squall export` writes it merged; a real node applies adapters
and rejects a tampered one; checkpoints round-trip; bad targets and mismatched checkpoints are
refused with errors naming the field; two gloo ranks make the single-process step and resume
a sharded checkpoint; a `squall up` run serves adapters end to end; and (marker gpu) the CUDA
path. The vLLM side is in test_inference_vllm.py."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
import torch
from distributed_helpers import run_world
from inference_helpers import NodeThread, weight_errors
from test_trainer_step import sampled_trajectory, step_batch
from transformers import AutoModelForCausalLM
from waiting import wait_for

from squall.inference.engines.torch_engine import TorchEngine
from squall.local.export import export, version_file
from squall.shared import bus
from squall.shared.adapterfiles import ADAPTER_CONFIG, ADAPTER_WEIGHTS, FORMAT_LORA, verify_adapter
from squall.shared.config import load_config
from squall.shared.errors import ConfigError, WeightsError
from squall.shared.keys import Keys
from squall.shared.schemas import WeightVersion, decode
from squall.trainer.backend import make_backend
from squall.trainer.publish import Publisher
from squall.trainer.sequences import trajectory_to_samples

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"
PROBE = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 300, 12, 64]])  # any ids below the vocab (512)

pytestmark = pytest.mark.skipif(not (POLICY / "config.json").exists(), reason="the calc policy is not built")


def lora_config(tmp_path, **trainer):
    return load_config(
        overrides={
            "run": {"name": "loratest", "dir": str(tmp_path / "run")},
            "model": {"path": str(POLICY)},
            "trainer": {"lr": 1e-3, "device": "cpu", "lora_rank": 4, **trainer},
        },
        env={},
    )


def fixed_samples(model, n=4):
    """Trajectories sampled from `model` (their real logprobs), advantages +-1."""
    trajs = [sampled_trajectory(model, "g", i, float(i % 2), seed=i) for i in range(n)]
    return [
        s for i, t in enumerate(trajs) for s in trajectory_to_samples(t, advantage=1.0 if i % 2 else -1.0)
    ]


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def served_logits(engine_model) -> torch.Tensor:
    with torch.no_grad():
        return engine_model(input_ids=PROBE).logits


def merged_logits(peft_model) -> torch.Tensor:
    """peft's own merge of the trainer's adapter into a copy of its base."""
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    with torch.no_grad():
        return merged(input_ids=PROBE).logits


def engine_serving(adapters: list[tuple[int, Path]]) -> list[torch.Tensor]:
    """A fresh torch engine on the base policy applies each adapter in turn; the logits it
    serves after each (and after the last, its base must be untouched)."""

    async def go() -> list[torch.Tensor]:
        section = load_config(
            env={}, overrides={"inference": {"device": "cpu", "max_model_len": 256}}
        ).inference
        engine = TorchEngine(str(POLICY), section)
        await engine.start()
        try:
            out = []
            for version, folder in adapters:
                await engine.apply_adapter(version, str(folder))
                assert engine.weight_version == version
                out.append(served_logits(engine.model))
            out.append(served_logits(engine._base))
            return out
        finally:
            await engine.stop()

    return asyncio.run(go())


@pytest.mark.redis
def test_lora_step_trains_adapters_only_and_inference_serves_the_merged_adapter(tmp_path, r):
    config = lora_config(tmp_path, kl_coef=0.05)
    backend = make_backend("torch", config)
    samples = fixed_samples(backend.model)
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    assert {id(p) for g in backend.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in backend.model.parameters() if p.requires_grad
    }
    before = snapshot(backend.model)
    first = backend.train_step(samples)
    assert first["kl"] == 0.0  # the reference is the base, and a fresh adapter (B = 0) is the base
    after = snapshot(backend.model)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed and changed <= trainable, sorted(changed - trainable)[:4]
    assert all(torch.equal(after[n], before[n]) for n in after if n not in trainable)  # base bit-identical
    assert any(".lora_B." in n for n in changed)

    publisher = Publisher(r, Keys("loratest"), tmp_path / "run", keep_versions=2,
                          adapter_config=backend.adapter_config())  # fmt: skip
    message = publisher.publish(1, 1, backend.weights())
    assert message.format == FORMAT_LORA
    folder = Path(message.location)
    assert sorted(p.name for p in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    verify_adapter(folder, message.checksum)
    adapter_bytes = sum(p.stat().st_size for p in folder.iterdir())
    assert adapter_bytes < 0.05 * (POLICY / "model.safetensors").stat().st_size, adapter_bytes
    config_json = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config_json["r"] == 4 and config_json["peft_type"] == "LORA"
    entry = r.xrange(Keys("loratest").weights)[-1][1]
    assert decode(entry[b"m"], WeightVersion).format == FORMAT_LORA
    trainer_v1 = merged_logits(backend.model)

    second = backend.train_step(samples)
    assert second["kl"] > 0  # the adapter moved away from the base
    v2 = publisher.publish(2, 2, backend.weights())
    trainer_v2 = merged_logits(backend.model)
    backend.model.eval()
    with torch.no_grad():  # the unmerged adapter forward agrees with peft's merge
        torch.testing.assert_close(backend.model(input_ids=PROBE).logits, trainer_v2, rtol=1e-4, atol=1e-4)

    served_v1, served_v2, base = engine_serving([(1, folder), (2, Path(v2.location))])
    torch.testing.assert_close(served_v1, trainer_v1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(served_v2, trainer_v2, rtol=1e-4, atol=1e-4)  # replaced, not stacked
    with backend.model.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(base, backend.model(input_ids=PROBE).logits, rtol=1e-5, atol=1e-5)
    assert (served_v2 - trainer_v1).abs().max() > 1e-3  # the versions differ: the checks can fail

    # `squall export` of a LoRA version: a plain HF model with the adapter merged in.
    out = export(str(POLICY), version_file(str(tmp_path / "run"), 2), tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    torch.testing.assert_close(served_logits(exported), trainer_v2, rtol=1e-4, atol=1e-4)


def test_unknown_target_module_is_refused_naming_the_field_and_the_layers(tmp_path):
    with pytest.raises(ConfigError) as caught:
        make_backend("torch", lora_config(tmp_path, lora_target_modules=["q_proj", "qkv_proj"]))
    text = str(caught.value)
    assert "trainer.lora_target_modules" in text and "'qkv_proj'" in text
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in text, text
    with pytest.raises(ConfigError, match=r"'embed_tokens' \(a Embedding\) is no linear layer"):
        make_backend("torch", lora_config(tmp_path, lora_target_modules=["embed_tokens"]))
    with pytest.raises(ConfigError, match="'lm_head' is 'lm_head', which shares its weight with the input"):
        make_backend("torch", lora_config(tmp_path, lora_target_modules=["q_proj", "lm_head"]))
    # peft's rule: a target may be a layer's trailing name parts, e.g. one layer's projection.
    one_layer = make_backend(
        "torch", lora_config(tmp_path, lora_target_modules=["layers.0.self_attn.q_proj"])
    )
    adapted = {n for n, p in one_layer.model.named_parameters() if p.requires_grad}
    assert adapted and all(".layers.0.self_attn.q_proj.lora_" in n for n in adapted), sorted(adapted)
    with pytest.raises(ConfigError, match=r"'layers.9.self_attn.q_proj' is no linear layer"):
        make_backend("torch", lora_config(tmp_path, lora_target_modules=["layers.9.self_attn.q_proj"]))
    with pytest.raises(ConfigError, match="trainer.lora_rank = 4 needs trainer.backend = 'torch'"):
        lora_config(tmp_path, backend="verl")


def test_lora_checkpoint_round_trip_and_a_mismatched_checkpoint_is_refused(tmp_path):
    config = lora_config(tmp_path)
    backend = make_backend("torch", config)
    samples = fixed_samples(backend.model)
    backend.train_step(samples)
    path = tmp_path / "state.pt"
    backend.save_state(path)
    saved = torch.load(path, weights_only=False)
    assert set(saved["model"]) == {n for n, p in backend.model.named_parameters() if p.requires_grad}

    resumed = make_backend("torch", config)
    resumed.load_state(path)
    # The same next step from the original and the resumed backend: adapters and Adam moments
    # (and the RNG) came back, so the updates are identical.
    a, b = backend.train_step(samples), resumed.train_step(samples)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (name, p), (_, q) in zip(
        backend.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name

    with pytest.raises(ConfigError, match=r"trained rank-4 LoRA adapters, but trainer.lora_rank = 0"):
        make_backend("torch", lora_config(tmp_path, lora_rank=0)).load_state(path)
    with pytest.raises(ConfigError, match=r"resume with the trainer.lora_\* settings"):
        make_backend("torch", lora_config(tmp_path, lora_target_modules=["q_proj"])).load_state(path)


@pytest.mark.redis
def test_node_applies_a_published_adapter_and_rejects_a_tampered_one(tmp_path, r, redis_url, run_name):
    backend = make_backend("torch", lora_config(tmp_path))
    samples = fixed_samples(backend.model)
    keys = Keys(run_name)
    publisher = Publisher(r, keys, tmp_path / "run", keep_versions=5, adapter_config=backend.adapter_config())
    backend.train_step(samples)
    publisher.publish(1, 1, backend.weights())
    node = NodeThread(POLICY, follow_weights=True, node="n1",
                      run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}).start()  # fmt: skip
    try:
        wait_for(lambda: r.hget(keys.versions, "inference:n1") == b"1", 60, what="node applies adapter v1")
        backend.train_step(samples)
        folder, checksum = publisher.write(2, backend.weights())
        weights = folder / ADAPTER_WEIGHTS
        weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # changed after it was written
        with pytest.raises(WeightsError, match="^checksum: adapter"):
            verify_adapter(folder, checksum)
        v2 = WeightVersion(
            run=run_name, version=2, step=2, location=str(folder), checksum=checksum, format=FORMAT_LORA
        )
        bus.publish(r, keys.weights, v2)
        wait_for(
            lambda: weight_errors(node).get("checksum", 0) >= 1, 60, what="node rejects the tampered adapter"
        )
        assert node.node.engine.weight_version == 1  # still serving the good one
        publisher.publish(3, 3, backend.weights())  # the same tensors again, intact
        wait_for(lambda: r.hget(keys.versions, "inference:n1") == b"3", 60, what="node applies adapter v3")
        assert node.node.engine.weight_version == 3
    finally:
        node.stop()


def lora_step_on_rank(model_path: str, run_dir: str, samples: list) -> dict:
    """One LoRA step on this rank's share of `samples`; rank 0 returns the gathered adapter."""
    config = load_config(env={}, overrides={
        "run": {"name": "loraws", "dir": run_dir}, "model": {"path": model_path},
        "trainer": {"lr": 1e-3, "device": "cpu", "lora_rank": 4, "max_tokens_per_microbatch": 24,
                    "kl_coef": 0.1},  # the base as reference, through the sharded model
    })  # fmt: skip
    backend = make_backend("torch", config)
    metrics = backend.train_step(samples)
    return {"weights": backend.weights(), "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}


@pytest.mark.slow
def test_two_ranks_make_the_single_process_lora_step(tmp_path):
    single = make_backend("torch", lora_config(tmp_path, max_tokens_per_microbatch=24))
    samples = fixed_samples(single.model)
    one = lora_step_on_rank(str(POLICY), str(tmp_path / "one"), samples)
    ranks = run_world(lora_step_on_rank, str(POLICY), str(tmp_path / "two"), samples, world_size=2)
    two = ranks[0]
    assert ranks[1]["weights"] == {}  # the adapter is gathered to rank 0 only
    assert set(two["weights"]) == set(one["weights"])
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert any(t.abs().max() > 0 for n, t in one["weights"].items() if ".lora_B." in n)  # the step moved B
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_two_ranks_lora_sharded_checkpoint_resumes_the_same_updates(tmp_path):
    from test_trainer_distributed import train_save_resume
    from test_trainer_step import make_tiny_model

    model_path = make_tiny_model(tmp_path / "model")
    samples = step_batch(model_path)
    trainer = {"max_tokens_per_microbatch": 40, "lora_rank": 4}
    (straight, resumed, files), _ = run_world(
        train_save_resume, str(tmp_path / "ranks"), str(model_path), samples, trainer
    )
    assert straight and all(".lora_A." in k or ".lora_B." in k for k in straight), sorted(straight)[:3]
    assert sum(name.endswith(".distcp") for name in files) == 2  # one shard file per rank
    from torch.distributed.checkpoint import FileSystemReader

    saved = (
        FileSystemReader(str(tmp_path / "ranks" / "ckpt" / "state.pt")).read_metadata().state_dict_metadata
    )
    model_keys = [k for k in saved if k.startswith("model.")]
    base = [k for k in model_keys if ".lora_" not in k]
    # Never the frozen base; torch keeps a tied lm_head (it is no named parameter of its own,
    # so ignore_frozen_params cannot see it is frozen): one embedding-sized tensor.
    assert model_keys and base == ["model.base_model.model.lm_head.weight"], base[:3]
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.redis
def test_a_lora_run_through_squall_up_publishes_adapters_that_inference_serves(tmp_path, monkeypatch):
    import squall
    from examples.calc.tasks import generate, write_jsonl
    from squall.shared.localredis import free_port

    write_jsonl(tmp_path / "train.jsonl", generate("train", 48, 0))
    write_jsonl(tmp_path / "val.jsonl", generate("val", 4, 0))
    monkeypatch.chdir(ROOT)  # the agent is examples.calc.agent, imported from the repo root
    run_dir = tmp_path / "run"
    cfg = squall.config(
        ROOT / "examples" / "calc" / "demo.toml",
        run={"name": "lorarun", "dir": str(run_dir), "redis_url": f"redis://127.0.0.1:{free_port()}/0"},
        scheduler={"dataset": str(tmp_path / "train.jsonl"), "val_dataset": str(tmp_path / "val.jsonl"),
                   "group_size": 4, "max_inflight_groups": 4, "val_samples": 4, "val_every": 100},
        trainer={"groups_per_step": 2, "max_steps": 3, "lora_rank": 8, "keep_versions": 10},
        runner={"concurrency": 8},
    )  # fmt: skip
    result = squall.up(cfg, runners=1, minutes=6, label="lora")
    assert result.ok, str(result)
    assert result.reason == "trainer reached max_steps", result.reason
    versions = result.summary["versions"]
    assert versions["trainer"] == 3, versions
    # A node acknowledges a version only once it serves it, and every version here is an
    # adapter: the node applied at least two of them without a restart.
    assert versions["inference:node0"] >= 2, versions
    assert result.ledger_balanced, result.ledger
    assert not {k: v for k, v in result.ledger.items() if k in ("pending", "running") and v}, result.ledger
    published = sorted(p for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
    assert [p.name for p in published] == [f"v{v:06d}" for v in range(4)], published
    for folder in published:  # every version, the initial one too, is an adapter and nothing else
        assert sorted(f.name for f in folder.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS], folder
        assert (folder / ADAPTER_WEIGHTS).stat().st_size < 0.2 * (POLICY / "model.safetensors").stat().st_size


@pytest.mark.gpu
def test_lora_step_and_merge_on_cuda(tmp_path):
    """The CUDA path: a LoRA step under bf16 autocast, then a CUDA engine (float32, so the
    check is the merge's, not bf16's) serving the adapter gives the trainer's logits."""
    from optional import need

    from squall.trainer.publish import write_adapter

    need("gpu", torch.cuda.is_available(), "no CUDA GPU here (torch.cuda.is_available() is False)")
    backend = make_backend("torch", lora_config(tmp_path, device="cuda", lr=1e-2))
    samples = fixed_samples(AutoModelForCausalLM.from_pretrained(str(POLICY)))  # sampled on CPU
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if not p.requires_grad}
    backend.train_step(samples)
    assert all(torch.equal(p, before[n]) for n, p in backend.model.named_parameters() if not p.requires_grad)
    folder = tmp_path / "v000001"
    write_adapter(folder, backend.weights(), backend.adapter_config(), version=1)
    backend.model.eval()
    with torch.no_grad():
        trainer = backend.model(input_ids=PROBE.cuda()).logits.float().cpu()
        with backend.model.disable_adapter():
            base = backend.model(input_ids=PROBE.cuda()).logits.float().cpu()

    async def serve() -> torch.Tensor:
        section = load_config(
            env={}, overrides={"inference": {"device": "cuda", "dtype": "float32"}}
        ).inference
        engine = TorchEngine(str(POLICY), section)
        await engine.start()
        try:
            await engine.apply_adapter(1, str(folder))
            with torch.no_grad():
                return engine.model(input_ids=PROBE.cuda()).logits.float().cpu()
        finally:
            await engine.stop()

    served = asyncio.run(serve())
    assert (trainer - base).abs().max() > 1e-2  # the step moved the adapter
    torch.testing.assert_close(served, trainer, rtol=1e-3, atol=1e-3)  # TF32 matmuls on the GPU

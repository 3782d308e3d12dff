"""Sharded weight publication against a real Redis and a real inference node: the trainer's
Publisher writes the Hugging Face layout (shards + index, checksums in the index), threads do
not change a byte, a node loads it and serves the published model's logprobs, a corrupt or
missing shard is refused while the node keeps its version, and single-file versions still load."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from inference_helpers import NodeThread, load_model, perturbed_versions, recompute_logprobs, weight_errors
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.shared import bus, schemas
from squall.shared.errors import WeightsError
from squall.shared.keys import Keys
from squall.shared.weightfiles import INDEX_FILE, ShardIndex, plan_shards, read_index, sha256_file, shard_name
from squall.trainer.publish import Publisher

torch.set_num_threads(1)
MESSAGES = [{"role": "user", "content": "Tell me a story about apples."}]
SMALL_SHARD = 200_000  # bytes: the 660 kB tiny model becomes several shards


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny_dir):
    versions = perturbed_versions(tiny_dir)
    third = load_model(tiny_dir)
    with torch.no_grad():
        for param in third.parameters():
            param.mul_(-1.0)
    return {**versions, 2: third}


def state_of(model) -> dict[str, torch.Tensor]:
    """As the torch trainer backend publishes: separate CPU copies of the full state dict."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def test_plan_keeps_order_and_bounds():
    sizes = [("a", 40), ("b", 50), ("c", 30), ("big", 500), ("d", 10), ("e", 95)]
    plan = plan_shards(sizes, 100)
    assert plan == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert [n for shard in plan for n in shard] == [n for n, _ in sizes]
    assert plan_shards(sizes, 10_000) == [[n for n, _ in sizes]]


def test_an_index_that_breaks_the_contract_is_refused_naming_the_problem():
    good = ShardIndex(
        weight_map={"w": shard_name(1, 2), "v": shard_name(2, 2)},
        shard_sha256={shard_name(1, 2): "a" * 64, shard_name(2, 2): "b" * 64},
        total_size=8,
    )
    assert ShardIndex.parse(good.to_bytes(), "x") == good
    doc = json.loads(good.to_bytes())
    doc["weight_map"]["u"] = "../../etc/passwd"
    with pytest.raises(WeightsError, match=r"^format: .*weight_map names shards without a checksum"):
        ShardIndex.parse(json.dumps(doc).encode(), "x")
    doc = json.loads(good.to_bytes())
    doc["metadata"]["shard_sha256"] = {
        "model-00001-of-00003.safetensors": "a" * 64,
        shard_name(2, 2): "b" * 64,
    }
    with pytest.raises(WeightsError, match=r"^format: .*shards must be model-00001-of-00002"):
        ShardIndex.parse(json.dumps(doc).encode(), "x")
    with pytest.raises(WeightsError, match=r"^format: .*needs metadata.shard_sha256"):
        ShardIndex.parse(b'{"weight_map": {}}', "x")


def test_threads_write_the_same_bytes_as_one(models, tmp_path):
    state = state_of(models[1])
    folders = []
    for threads in (1, 4):
        publisher = Publisher(None, Keys("t"), tmp_path / f"run{threads}", keep_versions=2,
                              shard_bytes=SMALL_SHARD, write_threads=threads)  # fmt: skip
        folder, checksum = publisher.write(3, state)
        assert checksum == sha256_file(folder / INDEX_FILE)
        folders.append(folder)
    names = sorted(p.name for p in folders[0].iterdir())
    assert names == sorted(p.name for p in folders[1].iterdir())
    assert len(names) >= 4 and INDEX_FILE in names  # several shards + the index
    for name in names:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name
    assert not [p for p in folders[0].parent.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.redis
def test_sharded_round_trip_serves_the_published_model(tiny_dir, models, r, redis_url, run_name, tmp_path):
    publisher = Publisher(r, Keys(run_name), tmp_path, keep_versions=2, shard_bytes=SMALL_SHARD)
    message = publisher.publish(1, 1, state_of(models[1]))
    assert message.format == "safetensors-sharded"
    index = read_index(message.location, message.checksum)
    state = models[1].state_dict()
    assert set(index.weight_map) == set(state)
    assert index.total_size == sum(t.numel() * t.element_size() for t in state.values())
    for shard in index.shards:
        assert sha256_file(f"{message.location}/{shard}") == index.shard_sha256[shard]

    # The Hugging Face layout: transformers loads the folder as it is (given a config).
    hf_dir = tmp_path / "hf"
    shutil.copytree(message.location, hf_dir)
    shutil.copy(tiny_dir / "config.json", hf_dir / "config.json")
    for name, tensor in load_model(hf_dir).state_dict().items():
        assert torch.equal(tensor, state[name]), name

    node = NodeThread(tiny_dir, follow_weights=True, node="n1",
                      run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}).start()  # fmt: skip
    try:
        wait_for(lambda: health(node)["weight_version"] == 1)
        reply = node.client().chat.completions.create(
            model="policy", messages=MESSAGES, max_tokens=8, logprobs=True,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        c = reply.choices[0]
        assert reply.model_extra["weight_version"] == 1
        expected = recompute_logprobs(
            models[1], c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
        )
        assert max(abs(e.logprob - x) for e, x in zip(c.logprobs.content, expected, strict=True)) < 1e-4
        assert r.hget(Keys(run_name).versions, "inference:n1") == b"1"
    finally:
        node.stop()


@pytest.mark.redis
def test_a_bad_shard_is_refused_and_the_node_keeps_its_version(
    tiny_dir, models, r, redis_url, run_name, tmp_path
):
    keys = Keys(run_name)
    publisher = Publisher(r, keys, tmp_path, keep_versions=5, shard_bytes=SMALL_SHARD)
    publisher.publish(1, 1, state_of(models[1]))
    node = NodeThread(tiny_dir, follow_weights=True, node="n1",
                      run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}).start()  # fmt: skip
    try:
        assert health(node)["weight_version"] == 1

        # Version 2: one shard's bytes changed after the index was written.
        folder, checksum = publisher.write(2, state_of(models[2]))
        shard = folder / read_index(folder).shards[-1]
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        announce(r, keys, 2, folder, checksum)
        wait_for(lambda: weight_errors(node).get("checksum") == 1)

        # Version 3: a shard gone.
        folder, checksum = publisher.write(3, state_of(models[2]))
        (folder / read_index(folder).shards[0]).unlink()
        announce(r, keys, 3, folder, checksum)
        wait_for(lambda: weight_errors(node).get("missing") == 1)

        assert ask_version(node) == 1  # still serving, still version 1
        assert r.hget(keys.versions, "inference:n1") == b"1"

        # Version 4: the old single-file layout, as runs before sharding wrote it, still loads.
        old_style = Publisher(r, keys, tmp_path, keep_versions=5, weights_format="safetensors")
        message = old_style.publish(4, 4, state_of(models[2]))
        assert message.location.endswith("/model.safetensors") and message.format == "safetensors"
        wait_for(lambda: health(node)["weight_version"] == 4)
        assert r.hget(keys.versions, "inference:n1") == b"4"
    finally:
        node.stop()


def announce(r, keys: Keys, version: int, folder, checksum: str) -> None:
    message = schemas.WeightVersion(run=keys.run, version=version, step=version, location=str(folder),
                                    checksum=checksum, format="safetensors-sharded")  # fmt: skip
    bus.publish(r, keys.weights, message)


def health(node) -> dict:
    return httpx.get(f"{node.url}/health").json()


def ask_version(node) -> int:
    reply = node.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
    return reply.model_extra["weight_version"]

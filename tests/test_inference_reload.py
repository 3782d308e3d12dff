"""Hot weight reload against a real Redis: versions published while requests are in flight,
corrupt or missing files rejected, the newest version loaded at start."""

from __future__ import annotations

import concurrent.futures
import hashlib

import httpx
import pytest
import redis
import torch
from inference_helpers import NodeThread, perturbed_versions, recompute_logprobs, weight_errors
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.shared import bus, schemas
from squall.shared.keys import Keys

torch.set_num_threads(1)
pytestmark = pytest.mark.redis
MESSAGES = [{"role": "user", "content": "Tell me a story about apples."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def models(tiny_dir):
    return perturbed_versions(tiny_dir)


def write_weights(run_dir, version, model) -> tuple[str, str]:
    """As the trainer does: the full state dict, separate copies, sha256 of the file."""
    from safetensors.torch import save_file

    folder = run_dir / "weights" / f"v{version:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def publish(r, run, version, location, checksum):
    message = schemas.WeightVersion(
        run=run, version=version, step=version, location=location, checksum=checksum
    )
    bus.publish(r, Keys(run).weights, message)


def start_node(tiny_dir, redis_url, run_name):
    return NodeThread(
        tiny_dir,
        follow_weights=True,
        node="n1",
        run={"name": run_name, "redis_url": redis_url, "autostart_redis": False},
    ).start()


def running_sequences(node) -> float:
    for line in httpx.get(f"{node.url}/metrics").text.splitlines():
        if line.startswith("squall_inference_running_sequences "):
            return float(line.split()[-1])
    return 0.0


def test_reload_mid_traffic_never_mixes_versions(tiny_dir, models, r, redis_url, run_name, tmp_path):
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        client = node.client()

        def ask(_):
            raw = client.chat.completions.with_raw_response.create(
                model="policy", messages=MESSAGES, max_tokens=24, logprobs=True,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            response = raw.parse()
            c = response.choices[0]
            version = response.model_extra["weight_version"]
            assert raw.headers["x-squall-weight-version"] == str(version)
            lps = [e.logprob for e in c.logprobs.content]
            return version, c.model_extra["prompt_token_ids"], c.model_extra["token_ids"], lps

        location, checksum = write_weights(tmp_path, 1, models[1])
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, i) for i in range(8)]
            # Requests are decoding now (or, on a fast machine, some already finished).
            wait_for(lambda: running_sequences(node) > 0 or any(f.done() for f in futures))
            publish(r, run_name, 1, location, checksum)
            futures += [pool.submit(ask, i) for i in range(16)]
            wait_for(lambda: httpx.get(f"{node.url}/health").json()["weight_version"] == 1)
            futures += [pool.submit(ask, i) for i in range(4)]
            results = [f.result() for f in futures]

        versions = [v for v, *_ in results]
        assert set(versions) == {0, 1}, versions
        for version, prompt_ids, token_ids, logprobs in results:
            own = recompute_logprobs(models[version], prompt_ids, token_ids)
            other = recompute_logprobs(models[1 - version], prompt_ids, token_ids)
            assert max(abs(a - b) for a, b in zip(logprobs, own, strict=True)) < 1e-4
            assert max(abs(a - b) for a, b in zip(logprobs, other, strict=True)) > 1e-2

        keys = Keys(run_name)
        started, loaded = [schemas.decode(f[schemas.ENTRY_FIELD], schemas.WeightApplied)
                           for _, f in r.xrange(keys.weights_applied)]  # fmt: skip
        assert (started.node, started.version) == ("n1", 0)  # on start: what it serves, nothing loaded
        assert (loaded.node, loaded.version) == ("n1", 1) and loaded.load_s > 0
        assert r.hget(keys.versions, "inference:n1") == b"1"
        assert b"inference:n1" in r.hkeys(keys.heartbeats)
    finally:
        node.stop()


def test_corrupt_or_missing_weights_keep_the_old_version(tiny_dir, models, r, redis_url, run_name, tmp_path):
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        location, checksum = write_weights(tmp_path, 1, models[1])
        publish(r, run_name, 1, location, "0" * 64)  # wrong checksum
        wait_for(lambda: weight_errors(node).get("checksum") == 1)
        publish(r, run_name, 2, str(tmp_path / "nowhere.safetensors"), checksum)
        wait_for(lambda: weight_errors(node).get("missing") == 1)
        garbage = tmp_path / "garbage.safetensors"
        garbage.write_bytes(b"\x00not a safetensors file" * 100)
        publish(r, run_name, 3, str(garbage), hashlib.sha256(garbage.read_bytes()).hexdigest())
        wait_for(lambda: weight_errors(node).get("load") == 1)
        r.xadd(Keys(run_name).weights, {schemas.ENTRY_FIELD: b"\xc1 not msgpack"})
        wait_for(lambda: weight_errors(node).get("message") == 1)

        reply = node.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
        assert reply.model_extra["weight_version"] == 0  # still serving, still version 0
        applied = [schemas.decode(f[schemas.ENTRY_FIELD], schemas.WeightApplied).version
                   for _, f in r.xrange(Keys(run_name).weights_applied)]  # fmt: skip
        assert applied == [0]  # said once, at start; no rejected version was ever claimed
        assert r.hget(Keys(run_name).versions, "inference:n1") == b"0"

        publish(r, run_name, 4, location, checksum)  # a good file is still taken afterwards
        wait_for(lambda: httpx.get(f"{node.url}/health").json()["weight_version"] == 4)
        assert r.hget(Keys(run_name).versions, "inference:n1") == b"4"
    finally:
        node.stop()


def test_a_starting_node_loads_the_newest_published_version(
    tiny_dir, models, r, redis_url, run_name, tmp_path
):
    location, checksum = write_weights(tmp_path, 1, models[1])
    publish(r, run_name, 1, location, checksum)
    node = start_node(tiny_dir, redis_url, run_name)
    try:
        assert httpx.get(f"{node.url}/health").json()["weight_version"] == 1  # before the first request
        reply = node.client().chat.completions.create(
            model="policy",
            messages=MESSAGES,
            max_tokens=6,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        c = reply.choices[0]
        expected = recompute_logprobs(
            models[1], c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
        )
        assert max(abs(e.logprob - x) for e, x in zip(c.logprobs.content, expected, strict=True)) < 1e-4
    finally:
        node.stop()


def test_the_follower_survives_a_redis_restart(tiny_dir, models, run_name, tmp_path):
    from squall.shared.localredis import LocalRedis

    server = LocalRedis(data_dir=tmp_path / "redis").start()
    port = server.port
    node = start_node(tiny_dir, server.url, run_name)
    try:
        server.close()  # Redis goes away under a following node
        wait_for(
            lambda: "squall_inference_redis_errors_total 0.0" not in httpx.get(f"{node.url}/metrics").text
        )
        assert node.client().chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2).choices
        server = LocalRedis(port=port, data_dir=tmp_path / "redis2").start()  # back, empty
        r = redis.Redis.from_url(server.url)
        location, checksum = write_weights(tmp_path, 1, models[1])
        publish(r, run_name, 1, location, checksum)
        wait_for(lambda: httpx.get(f"{node.url}/health").json()["weight_version"] == 1)
        assert r.hget(Keys(run_name).versions, "inference:n1") == b"1"
    finally:
        node.stop()
        server.close()


def test_a_node_exits_non_zero_naming_the_url_when_redis_stays_away(tiny_dir, run_name, tmp_path):
    from runner_helpers import Procs, log_of

    from squall.shared.localredis import LocalRedis, free_port

    server = LocalRedis(data_dir=tmp_path / "redis").start()
    procs, port = Procs(server.url, run_name, tmp_path, SQUALL_RUN__REDIS_OUTAGE_S="1.5"), free_port()
    try:
        node = procs.start("inference", "--model", str(tiny_dir), "--port", str(port), "--node", "n1")
        wait_for(
            lambda: b"inference:n1" in redis.Redis.from_url(server.url).hkeys(Keys(run_name).heartbeats), 60
        )
        server.close()
        assert node.wait(30) == 1
        log = log_of(node)
        assert '"redis_outage"' in log and f"127.0.0.1:{server.port}" in log and "did not come back" in log
    finally:
        procs.stop_all()
        server.close()


@pytest.mark.parametrize("swap", ["overlap", "drain"])
def test_a_new_version_serves_new_requests_while_old_ones_finish(
    tiny_dir, models, r, redis_url, run_name, tmp_path, swap
):
    """inference.swap=overlap: the first answer on version 1 comes while a long generation
    admitted on version 0 is still running (and that one stays all version 0); with drain it
    comes only after that generation finished: the stall overlap removes."""
    import time

    node = NodeThread(tiny_dir, follow_weights=True, node="n1", swap=swap,
                      run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}).start()  # fmt: skip
    try:
        client = node.client()
        finished: dict[str, float] = {}

        def long_generation():
            response = client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=900, n=8, extra_body={"ignore_eos": True}
            )
            finished["long"] = time.monotonic()
            return response.model_extra["weight_version"]

        def first_answer_on_version_1():
            while True:
                response = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2)
                if response.model_extra["weight_version"] == 1:
                    finished["new"] = time.monotonic()
                    return

        location, checksum = write_weights(tmp_path, 1, models[1])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(long_generation)
            wait_for(lambda: running_sequences(node) > 0, 20, "the long generation running")
            publish(r, run_name, 1, location, checksum)
            pool.submit(first_answer_on_version_1).result(timeout=120)
            assert long.result(timeout=120) == 0
        if swap == "overlap":
            assert finished["new"] < finished["long"], finished
        else:
            assert finished["new"] > finished["long"], finished
    finally:
        node.stop()

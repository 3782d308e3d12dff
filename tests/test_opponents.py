"""Opponents that do not learn, by configuration alone: a frozen model on an independent
OpenAI-compatible endpoint, a snapshot of the policy (an inference node pinned to version K,
or trailing the newest by N), and the share of seats they play — checked against a real Redis,
real inference nodes with the tiny model, the runner's real gateway and a plain HTTP server
that is not squall."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from inference_helpers import NodeThread, free_port, perturbed_versions
from waiting import wait_for

from squall.inference.tiny import build_tiny_model
from squall.inference.weights.reload import Snapshot
from squall.runner.gateway import Gateway, group_of, opponent_seats
from squall.shared.config import RunnerSection, load_config
from squall.shared.errors import ConfigError
from squall.shared.keys import Keys
from squall.trainer.publish import Publisher

torch.set_num_threads(1)
MESSAGES = [{"role": "user", "content": "Your move."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def weights(tiny_dir):
    """Three distinct state dicts (versions 1..3), as the trainer would publish them."""
    changed = perturbed_versions(tiny_dir)[1]
    out = {}
    for version in (1, 2, 3):
        out[version] = {k: (v * (1 + 0.1 * version)).detach().clone().contiguous()
                        for k, v in changed.state_dict().items()}  # fmt: skip
    return out


class IndependentEndpoint:
    """A minimal OpenAI-compatible chat server that has nothing to do with squall: it answers
    every chat call with a fixed sentence naming the model it was asked for."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append({"path": self.path, **body})
                reply = {
                    "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": f"judge {body['model']} says ok"}}],
                }  # fmt: skip
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def snapshot_node(tiny_dir, redis_url, run_name, name, **section):
    return NodeThread(
        tiny_dir, follow_weights=True, node=name,
        run={"name": run_name, "redis_url": redis_url, "autostart_redis": False}, **section,
    )  # fmt: skip


def served_version(node) -> int:
    return httpx.get(f"{node.url}/health", timeout=5).json()["weight_version"]


# --- pure parts --------------------------------------------------------------------------------


def test_snapshot_target_against_a_plain_reference():
    import random

    rng = random.Random(0)
    for _ in range(300):
        published = sorted(rng.sample(range(40), rng.randint(0, 12)))
        pin, behind = rng.choice([-1, rng.randint(0, 40)]), rng.randint(0, 6)
        snap = Snapshot(pin, 0 if pin >= 0 else behind)
        if pin >= 0:
            expected = pin if pin in published else None
        elif not published:
            expected = None
        else:  # the newest published version at or below newest - behind, else none
            below = [v for v in published if v <= published[-1] - behind]
            expected = below[-1] if below else None
        assert snap.target(published) == expected


def test_seat_draw_is_per_group_exact_and_seeded():
    seats = ["a1", "a2", "b1", "b2"]
    assert group_of("g17:3#2") == "g17" and group_of("val:g2:0#0") == "val:g2"
    drawn = [opponent_seats(seats, 0.5, f"g{i}") for i in range(400)]
    assert all(len(d) == 2 and set(d) <= set(seats) for d in drawn)
    assert drawn == [opponent_seats(seats, 0.5, f"g{i}") for i in range(400)]  # every runner agrees
    counts = {s: sum(s in d for d in drawn) for s in seats}
    assert all(150 < c < 250 for c in counts.values()), counts  # each seat about half the time
    assert opponent_seats(seats, 0.0, "g") == [] and opponent_seats(seats, 1.0, "g") == seats
    assert len(opponent_seats(seats, 0.25, "g")) == 1


def test_bad_opponent_config_is_refused_naming_the_field():
    bad = [
        ({"seats": ["red", "blue"], "train_agents": ["green"]}, "runner.train_agents names ['green']"),
        ({"opponent_model": "old-me"}, "runner.opponent_model 'old-me' is not a key of runner.frozen_models"),
        ({"opponent_fraction": 0.5}, "runner.opponent_fraction > 0 needs runner.opponent_model"),
    ]
    for runner, message in bad:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(env={}, overrides={"runner": runner})
    with pytest.raises(ConfigError, match="pin_version and inference.behind_versions exclude"):
        load_config(env={}, overrides={"inference": {"pin_version": 2, "behind_versions": 1}})


# --- snapshot nodes against a real Redis --------------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_a_snapshot_keeps_serving_version_k_while_the_policy_moves_on(
    tiny_dir, weights, r, redis_url, run_name, tmp_path
):
    keys = Keys(run_name)
    publisher = Publisher(r, keys, tmp_path, keep_versions=1)
    publisher.publish(1, 1, weights[1])
    nodes = {
        "policy": snapshot_node(tiny_dir, redis_url, run_name, "policy"),
        "pinned": snapshot_node(
            tiny_dir, redis_url, run_name, "pinned", pin_version=1, model_name="opponent"
        ),
        "behind": snapshot_node(tiny_dir, redis_url, run_name, "behind", behind_versions=1),
    }
    try:
        for node in nodes.values():
            node.start()
        assert served_version(nodes["pinned"]) == 1 and served_version(nodes["behind"]) == 0  # 1 - 1
        for version in (2, 3):
            publisher.publish(version, version, weights[version])
            wait_for(
                lambda v=version: served_version(nodes["policy"]) == v,
                timeout_s=30,
                what=f"policy at v{version}",
            )
            wait_for(
                lambda v=version: served_version(nodes["behind"]) == v - 1, timeout_s=30, what="trailing node"
            )
            publisher.prune()
        assert served_version(nodes["pinned"]) == 1
        reply = httpx.post(f"{nodes['pinned'].url}/v1/chat/completions", timeout=30,
                           json={"model": "opponent", "messages": MESSAGES, "max_tokens": 4}).json()  # fmt: skip
        assert reply["weight_version"] == 1
        versions = {k.decode(): int(v) for k, v in r.hgetall(keys.versions).items()}
        assert versions["snapshot:pinned"] == 1 and versions["inference:behind"] == 2
        assert versions["inference:policy"] == 3
        # v1 stays on disk for the pinned node; v2 for the trailing one; newest kept
        assert publisher.on_disk() == [1, 2, 3]
        nodes["behind"].stop()
        r.hdel(keys.versions, "inference:behind")
        publisher.prune()
        assert publisher.on_disk() == [1, 3]  # the pin holds v1 only, not everything after it
    finally:
        for node in nodes.values():
            node.stop()


@pytest.mark.redis
def test_a_pin_that_cannot_be_served_refuses_to_start(tiny_dir, weights, r, redis_url, run_name, tmp_path):
    publisher = Publisher(r, Keys(run_name), tmp_path, keep_versions=5)
    publisher.publish(1, 1, weights[1])
    node = snapshot_node(tiny_dir, redis_url, run_name, "typo", pin_version=7)
    with pytest.raises(RuntimeError, match=r"inference.pin_version: version 7 was never published .*1\.\.1"):
        node.start()
    publisher.publish(2, 2, weights[2])
    shutil.rmtree(tmp_path / "weights" / "v000002")
    node = snapshot_node(tiny_dir, redis_url, run_name, "gone", pin_version=2)
    with pytest.raises(RuntimeError, match="inference.pin_version: version 2 cannot be loaded"):
        node.start()


# --- the gateway: seats, opponents, a frozen endpoint on its own --------------------------------


async def _seat_calls(gateway: Gateway, key: str, seats: list[str]) -> list:
    """One call per seat, each through its own agent URL, all asking for the policy."""
    from openai import AsyncOpenAI

    attempt = gateway.open(key)
    try:
        for seat in seats:
            client = AsyncOpenAI(base_url=gateway.base_url(attempt.token, seat), api_key="x", max_retries=0)
            reply = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
            assert reply.model == "policy"  # the agent sees the name it asked for
        judge = AsyncOpenAI(base_url=gateway.base_url(attempt.token), api_key="x", max_retries=0)  # "main"
        verdict = await judge.chat.completions.create(model="referee", messages=MESSAGES, max_tokens=4)
        assert verdict.choices[0].message.content == "judge referee says ok"
        return attempt.turns
    finally:
        gateway.close(attempt.token)


async def _run_gateway(section: RunnerSection, body) -> list:
    gateway = Gateway(section, "policy")
    await gateway.start()
    try:
        return await body(gateway)
    finally:
        await gateway.stop()


@pytest.mark.redis
@pytest.mark.slow
def test_opponent_seats_play_the_snapshot_and_are_recorded_untrained(
    tiny_dir, weights, r, redis_url, run_name, tmp_path
):
    Publisher(r, Keys(run_name), tmp_path, keep_versions=5).publish(1, 1, weights[1])
    policy = snapshot_node(tiny_dir, redis_url, run_name, "policy").start()
    pinned = snapshot_node(tiny_dir, redis_url, run_name, "old", pin_version=1, model_name="old-me").start()
    Publisher(r, Keys(run_name), tmp_path, keep_versions=5).publish(2, 2, weights[2])
    wait_for(lambda: served_version(policy) == 2, timeout_s=30, what="policy at v2")
    judge = IndependentEndpoint()
    seats = ["a1", "a2", "b1", "b2"]
    section = RunnerSection(
        inference_urls=[policy.url], frozen_models={"old-me": pinned.url, "referee": judge.url},
        seats=seats, train_agents=["a1", "a2", "b1"], opponent_model="old-me", opponent_fraction=0.5,
    )  # fmt: skip
    try:
        keys = ["g1:0#0", "g1:1#0", "g2:0#0"]
        results = asyncio.run(_run_gateway(
            section, lambda gw: asyncio.gather(*(_seat_calls(gw, k, seats) for k in keys))))  # fmt: skip
    finally:
        judge.stop()
        pinned.stop()
        policy.stop()
    for key, turns in zip(keys, results, strict=True):
        expected = opponent_seats(seats, 0.5, group_of(key))
        assert len(expected) == 2
        assert [t.agent for t in turns] == [*seats, "main"]
        for turn in turns[:4]:
            if turn.agent in expected:  # played by the pinned snapshot: its name, its version, untrained
                assert (turn.model, turn.trained, turn.version) == ("old-me", False, 1)
            else:  # the policy; b2 is outside train_agents, so recorded untrained too
                assert (turn.model, turn.trained, turn.version) == ("policy", turn.agent != "b2", 2)
                assert len(turn.response_tokens) == len(turn.logprobs) > 0
        assert (turns[4].model, turns[4].trained, turns[4].version) == ("referee", False, -1)
    assert [t.model for t in results[0]] == [t.model for t in results[1]]  # one line-up per group
    assert judge.requests and all(q["model"] == "referee" for q in judge.requests)
    assert all("return_token_ids" not in q for q in judge.requests)  # forwarded unchanged


def test_an_unknown_seat_and_a_frozen_endpoint_that_is_down_are_clear_errors():
    down = f"http://127.0.0.1:{free_port()}"
    section = RunnerSection(
        inference_urls=[down], frozen_models={"old-me": down}, seats=["red", "blue"],
        upstream_retries=1,
    )  # fmt: skip

    async def body(gateway: Gateway):
        attempt = gateway.open("g1:0#0")
        async with httpx.AsyncClient(timeout=10) as client:
            typo = await client.post(f"{gateway.base_url(attempt.token, 'gren')}/chat/completions",
                                     json={"model": "policy", "messages": MESSAGES})  # fmt: skip
            frozen = await client.post(f"{gateway.base_url(attempt.token, 'red')}/chat/completions",
                                       json={"model": "old-me", "messages": MESSAGES})  # fmt: skip
        return typo, frozen, attempt

    typo, frozen, attempt = asyncio.run(_run_gateway(section, body))
    assert typo.status_code == 404
    assert "agent 'gren' is not one of runner.seats ['red', 'blue']" in typo.json()["error"]["message"]
    assert frozen.status_code == 502
    message = frozen.json()["error"]["message"]
    assert f"frozen model 'old-me' in runner.frozen_models ({down}/v1) is up" in message
    assert attempt.turns == [] and attempt.error is None  # nothing recorded; the agent decides what to do

"""The health endpoint every non-FastAPI service starts: /health, /ready, /metrics over real HTTP."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from prometheus_client import CollectorRegistry
from waiting import wait_for

from squall.monitor.health import start_health_server
from squall.monitor.metrics import QueueCollector, standard_metrics
from squall.shared import bus, schemas
from squall.shared.keys import GROUP_RUNNERS, Keys
from squall.shared.ledger import Ledger


@pytest.fixture
def registry():
    return CollectorRegistry()


def test_health_ready_and_metrics(registry):
    ready = threading.Event()
    server, port = start_health_server(
        "127.0.0.1", 0, ready.is_set, registry=registry, info=lambda: {"slots": 4}
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "slots": 4}
        not_ready = httpx.get(f"{base}/ready")
        assert not_ready.status_code == 503 and not_ready.json() == {"ready": False}
        ready.set()
        assert httpx.get(f"{base}/ready").status_code == 200

        m = standard_metrics(registry)
        assert standard_metrics(registry) is m  # idempotent per registry
        m.attempts.labels(status="ok").inc(3)
        m.rollout_seconds.labels(mode="train").observe(2.5)
        m.weight_version.labels(role="served").set(7)
        m.tokens.labels(kind="response").inc(120)
        m.errors.labels(kind="upstream").inc()
        text = httpx.get(f"{base}/metrics").text
        assert 'squall_attempts_total{status="ok"} 3.0' in text
        assert 'squall_rollout_seconds_bucket{le="5.0",mode="train"} 1.0' in text
        assert 'squall_weight_version{role="served"} 7.0' in text
        assert 'squall_tokens_total{kind="response"} 120.0' in text
        assert 'squall_errors_total{kind="upstream"} 1.0' in text
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        server.close()
    with socket.socket() as sock:  # the port is free again once closed
        sock.bind(("127.0.0.1", port))
    server.close()  # twice is harmless


def test_ready_that_raises_is_not_ready_and_liveness_survives(registry):
    def ready() -> bool:
        raise ConnectionError("redis is away")

    def info() -> dict:
        raise RuntimeError("boom")

    server, port = start_health_server(ready=ready, registry=registry, info=info)
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/ready")
        assert answer.status_code == 503 and "redis is away" in answer.json()["reason"]
        health = httpx.get(f"http://127.0.0.1:{port}/health")
        assert health.status_code == 200 and health.json()["info_error"] == "RuntimeError"
    finally:
        server.close()


def test_metrics_api_key(registry):
    server, port = start_health_server(registry=registry, api_key="k3y")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 401
        assert (
            httpx.get(
                f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer wrong"}
            ).status_code
            == 401
        )
        assert (
            httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer k3y"}).status_code
            == 200
        )
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # probes need no key
    finally:
        server.close()


@pytest.mark.redis
def test_queue_collector_reports_lag_pending_and_ledger(r, run_name, registry):
    keys = Keys(run_name)
    tasks = [
        schemas.Task(run=run_name, task_id=f"g:{i}", group_id="g", sample_id="s", index=i, group_size=3,
                     payload={}, deadline=2e9)
        for i in range(3)
    ]  # fmt: skip
    consumer = bus.GroupConsumer(r, keys.tasks, GROUP_RUNNERS, "runner-0", kind=schemas.Task,
                                 deadletter_stream=keys.deadletter)  # fmt: skip
    bus.publish_many(r, keys.tasks, tasks)
    Ledger(r, keys).move([t.key for t in tasks], "pending", allowed_from=["new"])
    consumer.read(1, block_ms=10)
    r.hincrby(keys.infra, "retried:connection", 3)  # as the scheduler counts infrastructure retries
    registry.register(QueueCollector(r, keys))
    server, port = start_health_server(registry=registry)
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.close()
    assert 'squall_queue_lag_entries{group="runners",stream="tasks"} 2.0' in text
    assert 'squall_queue_pending_entries{group="runners",stream="tasks"} 1.0' in text
    assert 'squall_stream_length_entries{stream="tasks"} 3.0' in text
    assert 'squall_ledger_attempts{state="pending"} 3.0' in text
    assert "squall_ledger_balanced 1.0" in text
    assert 'squall_infra_attempts{outcome="retried",reason="connection"} 3.0' in text


@pytest.mark.slow
def test_trainer_subprocess_serves_health_ready_and_metrics(tmp_path, r, redis_url, run_name):
    """A real trainer: its heartbeat names its metrics port; /ready once the model is loaded;
    after a step /metrics has the step, the version (role=trainer), trained tokens and tokens/s;
    SIGTERM exits 0."""
    import json
    import signal

    import torch
    from test_trainer_e2e import publish_dataset, start_trainer, trained_log, write_config
    from test_trainer_step import make_tiny_model
    from transformers import AutoModelForCausalLM

    from squall.shared.keys import GROUP_TRAINER

    torch.set_num_threads(1)
    model_path = make_tiny_model(tmp_path / "model")
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)
    publish_dataset(r, keys, AutoModelForCausalLM.from_pretrained(model_path))
    config = write_config(tmp_path, redis_url, run_name, model_path)
    proc = start_trainer(config)
    try:
        beat = wait_for(lambda: r.hget(keys.heartbeats, "trainer:trainer"), 120, "the trainer's heartbeat")
        base = f"http://127.0.0.1:{json.loads(beat)['metrics_port']}"
        assert httpx.get(f"{base}/ready").status_code == 200  # heartbeats start after the model loaded
        wait_for(lambda: len(trained_log(tmp_path / "run")) >= 2, 120, "two steps")
        health = httpx.get(f"{base}/health").json()
        assert health["status"] == "ok" and health["step"] >= 2
        text = httpx.get(f"{base}/metrics").text
        samples = scrape_values(text)
        assert samples["squall_trainer_step"] >= 2
        assert samples['squall_weight_version{role="trainer"}'] >= 2
        assert samples['squall_tokens_total{kind="trained"}'] > 0
        assert samples['squall_tokens_per_second{service="trainer"}'] > 0
        assert samples['squall_deadlettered_total{source="trajectories"}'] == 1  # the out-of-vocab one
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def scrape_values(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out

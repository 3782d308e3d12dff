"""OpenTelemetry spans (services/tracking/otel.py) received by a real OTLP/HTTP endpoint started
in the test: a small HTTP server that decodes each ExportTraceServiceRequest (protobuf, as the
SDK's exporter sends it) with opentelemetry-proto.

A real runner (the calculator agent on the tiny policy, served by a real inference node) sends
each attempt's trace; the trainer's step and publication spans are made with the same Tracer
the trainer uses, linked to those attempts. The tree and the links are checked id by id. An
endpoint that is down costs the run nothing: spans are dropped and counted."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from runner_helpers import Procs, dispatch, log_of, trajectories
from waiting import wait_for

from squall.shared.keys import Keys
from squall.shared.localredis import free_port
from squall.tracking.otel import Tracer, attempt_ids, call_span_id, publication_ids

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "examples" / "calc" / "policy"


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Collector:
    """An OTLP/HTTP trace receiver on a free port: every span it was sent, decoded."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list[dict] = []
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                assert self.path == "/v1/traces", self.path
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = {a.key: _value(a.value) for a in resource.resource.attributes}["service.name"]
                    for scope in resource.scope_spans:
                        for s in scope.spans:
                            owner.spans.append({
                                "service": service, "name": s.name, "trace": s.trace_id.hex(), "span": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                "end": s.end_time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "links": [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            })  # fmt: skip
                owner.requests += 1
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _hex(trace_id: int, span_id: int) -> tuple[str, str]:
    return f"{trace_id:032x}", f"{span_id:016x}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_attempt_trace_llm_calls_step_and_publication_linked(r, redis_url, run_name, tmp_path):
    if not (POLICY / "config.json").exists():
        pytest.skip("the calculator policy is not built (examples/calc/sft.py)")
    collector = Collector()
    port = free_port()
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_TRACKING__OTLP_ENDPOINT=collector.url,
                  SQUALL_RUNNER__INFERENCE_URLS=f'["http://127.0.0.1:{port}"]')  # fmt: skip
    try:
        procs.start("inference", "--model", str(POLICY), "--port", str(port), "--node", "n1")
        wait_for(lambda: r.hexists(Keys(run_name).heartbeats, "inference:n1"), 120, "the inference node")
        runner = procs.start("runner", "--agent", "examples.calc.agent:agent", "--concurrency", "2")
        dispatch(r, run_name, [{"question": f"What is {a} + 17?", "answer": a + 17} for a in (20, 31)])
        wait_for(lambda: len(trajectories(r, run_name)) == 2, 120, "two trajectories")
        runner.terminate()
        assert runner.wait(30) == 0
    finally:
        procs.stop_all()
    done = trajectories(r, run_name)
    wait_for(lambda: len(collector.named("attempt")) == 2, 10, "two attempt spans")

    # The trainer's side: one step trained both attempts and published version 1.
    trainer = Tracer(run_name, "trainer", collector.url)
    began = time.time()
    step = trainer.trainer_step(1, [t.key for t in done], began, began + 0.2, published=1)
    trainer.publication(1, 1, began + 0.2, began + 0.3, step)
    trainer.close()
    collector.close()

    (step_span,) = collector.named("trainer step")
    (publication,) = collector.named("publish weights")
    assert step_span["service"] == "squall-trainer" and step_span["attributes"]["squall.weight_version"] == 1
    assert publication["links"] == [(step_span["trace"], step_span["span"])]  # version -> step
    assert (publication["trace"], publication["span"]) == _hex(*publication_ids(run_name, 1))
    for t in done:
        trace, span = _hex(*attempt_ids(run_name, t.key))
        (root,) = [s for s in collector.named("attempt") if s["trace"] == trace]
        assert root["span"] == span and root["parent"] == "" and root["service"] == "squall-runner"
        assert (
            root["attributes"]["squall.attempt"] == t.key and root["attributes"]["squall.status"] == t.status
        )
        assert (trace, span) in step_span["links"]  # step -> attempt
        calls = sorted(
            (s for s in collector.spans if s["trace"] == trace and s is not root), key=lambda s: s["start"]
        )
        assert len(calls) == len(t.turns) >= 1
        for i, (call, turn) in enumerate(zip(calls, t.turns, strict=True)):
            assert call["parent"] == span and call["span"] == f"{call_span_id(run_name, t.key, i):016x}"
            assert call["name"] == "chat policy" and call["attributes"]["gen_ai.request.model"] == "policy"
            assert call["attributes"]["gen_ai.usage.output_tokens"] == len(turn.response_ids) // 4
            assert call["attributes"]["squall.weight_version"] == turn.version == 0
            assert root["start"] <= call["start"] <= call["end"] <= root["end"]
        assert root["links"] == [_hex(*publication_ids(run_name, 0))]  # attempt -> the version that served it


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_endpoint_that_is_down_drops_and_counts_spans_and_the_run_goes_on(
    r, redis_url, run_name, tmp_path
):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    procs = Procs(redis_url, run_name, tmp_path, SQUALL_TRACKING__OTLP_ENDPOINT=dead)
    try:
        runner = procs.start("runner", "--agent", "runner_agents:trivial", "--concurrency", "3")
        dispatch(r, run_name, [{"reward": 1.0} for _ in range(3)])
        wait_for(lambda: len(trajectories(r, run_name)) == 3, 60, "three trajectories")
        assert all(t.status == "ok" for t in trajectories(r, run_name))
        runner.terminate()
        assert runner.wait(30) == 0
    finally:
        procs.stop_all()
    log = log_of(runner)
    assert '"otel_spans_dropped"' in log and '"spans":3' in log, log[-2000:]


def test_tracing_off_imports_nothing_heavy():
    import subprocess
    import sys

    code = ("import sys; from squall.shared.config import RunConfig; from squall.tracking.otel import tracer_for; "
            "t = tracer_for(RunConfig(), 'runner'); t.attempt(None, 0, 0, []); "
            "print(t.enabled, any(m.startswith('opentelemetry') for m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_trainer_step_and_publication_spans_and_a_paused_trainer_is_a_stall(
    r, redis_url, run_name, tmp_path
):
    """A real trainer (tiny model, CPU) sends a span per step linked to the attempts it trained
    (as its trained.jsonl lists them) and a publication span per version linked to its step.
    SIGSTOP it while trajectories wait: `trainer_stalled`; SIGCONT: it steps again, cleared."""
    import os
    import signal
    import subprocess
    import sys

    import torch
    from test_stalls import kinds
    from test_trainer_e2e import trained_log, write_config
    from test_trainer_step import make_tiny_model, sampled_trajectory
    from transformers import AutoModelForCausalLM

    from squall.shared import bus
    from squall.shared.keys import GROUP_TRAINER
    from squall.shared.schemas import Trajectory

    torch.set_num_threads(1)
    collector = Collector()
    model_path = make_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    keys = Keys(run_name)
    bus.ensure_group(r, keys.trajectories, GROUP_TRAINER)

    def publish_groups(groups: range) -> None:
        for g in groups:
            members = [sampled_trajectory(model, f"g{g}", i, float(i % 2), seed=g * 10 + i) for i in range(4)]
            bus.publish_many(r, keys.trajectories,
                             [Trajectory(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "run": run_name})
                              for t in members])  # fmt: skip

    config = write_config(tmp_path, redis_url, run_name, model_path)
    env = {**os.environ, "SQUALL_TRACKING__OTLP_ENDPOINT": collector.url, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "squall.cli", "trainer", "--config", str(config)], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    run_dir = tmp_path / "run"
    try:
        publish_groups(range(2))
        wait_for(lambda: len(trained_log(run_dir)) >= 2, 180, "two steps")
        proc.send_signal(signal.SIGSTOP)  # the trainer is paused; rollouts go on
        publish_groups(range(2, 4))
        wait_for(lambda: "trainer_stalled" in kinds(r, run_name), 10, "trainer_stalled")
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: len(trained_log(run_dir)) >= 4, 120, "two more steps")
        wait_for(lambda: "trainer_stalled" not in kinds(r, run_name), 10, "the stall to clear")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    collector.close()
    steps = {s["attributes"]["squall.step"]: s for s in collector.named("trainer step")}
    publications = {s["attributes"]["squall.weight_version"]: s for s in collector.named("publish weights")}
    for line in trained_log(run_dir):
        step = steps[line["step"]]
        assert step["service"] == "squall-trainer"
        assert set(step["links"]) == {_hex(*attempt_ids(run_name, key)) for key in line["keys"]}
        version = step["attributes"]["squall.weight_version"]
        assert (publications[version]["trace"], publications[version]["span"]) == _hex(
            *publication_ids(run_name, version)
        )
        assert publications[version]["links"] == [(step["trace"], step["span"])]


def test_gateway_sends_each_calls_traceparent_upstream():
    """The node sees the `traceparent` of the call's span, so its own spans join the attempt."""
    import asyncio
    import json as jsonlib

    import httpx

    from squall.runner.gateway import Gateway
    from squall.shared.config import load_config
    from squall.tracking.otel import traceparent

    seen: list[str | None] = []

    class Upstream(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            seen.append(self.headers.get("traceparent"))
            body = jsonlib.dumps({"weight_version": 0, "node": "fake", "prompt_token_ids": [1, 2], "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                 "token_ids": [5], "logprobs": {"content": [{"logprob": -0.5}]}}]}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    section = load_config(env={}, overrides={"runner": {"inference_urls": [url], "gateway_port": 0}}).runner
    key = "g1:0#0"

    async def two_calls() -> None:
        gateway = Gateway(section, "policy")
        await gateway.start()
        try:
            attempt = gateway.open(key)
            attempt.trace_parent = lambda i: traceparent(7, call_span_id("run", key, i))
            async with httpx.AsyncClient() as client:
                for _ in range(2):
                    reply = await client.post(f"{gateway.base_url(attempt.token)}/chat/completions",
                                              json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
                    assert reply.status_code == 200, reply.text
            assert len(attempt.turns) == 2 and len(attempt.call_starts) == 2
        finally:
            await gateway.stop()

    try:
        asyncio.run(two_calls())
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [traceparent(7, call_span_id("run", key, 0)), traceparent(7, call_span_id("run", key, 1))]

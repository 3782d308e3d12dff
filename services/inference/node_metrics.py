"""Prometheus metrics of one inference node, in a registry of its own (so several nodes can
live in one process, as in tests)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily


class InferenceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "squall_inference_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "squall_inference_request_seconds",
            "Time from request to the last byte of the response",
            ["endpoint"],
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
            registry=r,
        )
        self.prompt_tokens = Counter("squall_inference_prompt_tokens", "Prompt tokens served", registry=r)
        self.generated_tokens = Counter("squall_inference_generated_tokens", "Tokens sampled", registry=r)
        self.weight_version = Gauge(
            "squall_inference_weight_version", "Weight version served now", registry=r
        )
        # The standard squall name (squall.monitor.metrics), so one rule reads every service.
        self.served_version = Gauge(
            "squall_weight_version", "Policy weight version this process holds", ["role"], registry=r
        ).labels(role="served")
        self.weight_reloads = Counter("squall_inference_weight_reloads", "Weight versions loaded", registry=r)
        self.weight_errors = Counter(
            "squall_inference_weight_errors",
            "Weight versions that could not be loaded (old version kept), by reason",
            ["reason"],
            registry=r,
        )
        self.reload_seconds = Histogram(
            "squall_inference_reload_seconds",
            "Seconds from reading a WeightVersion to serving it",
            buckets=(0.1, 0.3, 1, 3, 10, 30, 100, 300),
            registry=r,
        )
        self.redis_errors = Counter(
            "squall_inference_redis_errors", "Redis outages the weight follower rode through", registry=r
        )
        # The standard squall name (squall.monitor.metrics): kind="redis_outage" as in every service.
        self.errors = Counter(
            "squall_errors", "Caught-and-retried or dead-lettered errors, by kind", ["kind"], registry=r
        )
        self.tool_parse_failures = Counter(
            "squall_inference_tool_parse_failures",
            "Chat replies whose tool-call-like text did not parse (it stayed content)",
            registry=r,
        )
        self.running = Gauge("squall_inference_running_sequences", "Sequences decoding now", registry=r)
        self.waiting = Gauge(
            "squall_inference_waiting_requests", "Requests waiting for a batch slot", registry=r
        )

    def count_redis_outage(self) -> None:
        self.redis_errors.inc()
        self.errors.labels(kind="redis_outage").inc()

    def watch_engine(self, stats: Callable[[], dict[str, int]]) -> None:
        self.running.set_function(lambda: stats()["running"])
        self.waiting.set_function(lambda: stats()["waiting"])
        self.registry.register(_EngineTotals(stats))


class _EngineTotals:
    """The engine's own running totals, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.stats = stats

    def collect(self):
        now = self.stats()
        forwards = CounterMetricFamily(
            "squall_inference_forward_passes", "Model forward passes (prefill or decode)"
        )
        forwards.add_metric([], now["forward_passes"])
        tokens = CounterMetricFamily(
            "squall_inference_batched_tokens", "Tokens sampled by those forward passes"
        )
        tokens.add_metric([], now["sampled_tokens"])
        return [forwards, tokens]

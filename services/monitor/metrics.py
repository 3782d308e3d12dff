"""The standard Prometheus metrics of squall, named in one place.

Every service exposes the ones that apply to it; names and labels are the same everywhere,
so one dashboard or alert rule reads any deployment:

| name | type | labels | who updates it |
|---|---|---|---|
| squall_queue_lag_entries | gauge | stream, group | QueueCollector (scrape time, from XINFO GROUPS) |
| squall_queue_pending_entries | gauge | stream, group | QueueCollector (delivered, not acked) |
| squall_stream_length_entries | gauge | stream | QueueCollector |
| squall_ledger_attempts | gauge | state | QueueCollector (shared.ledger counts) |
| squall_ledger_balanced | gauge | | QueueCollector (1 when conservation holds) |
| squall_infra_attempts | gauge | outcome, reason | QueueCollector: attempts failed because no policy node answered (`infra` hash: retried / charged / given_up) |
| squall_attempts_total | counter | status | runner: one per finished attempt (ok/failed/timeout/cancelled) |
| squall_rollout_seconds | histogram | mode | runner: wall time of one attempt |
| squall_inflight_attempts | gauge | | runner: slots busy now |
| squall_tokens_total | counter | kind | runner (response/prompt tokens recorded), trainer (trained) |
| squall_tokens_per_second | gauge | service | trainer: trained tokens/s of the last step; inference: decode rate |
| squall_weight_version | gauge | role | trainer (published), inference (served), runner/scheduler (seen) |
| squall_errors_total | counter | kind | everyone: caught-and-retried or dead-lettered errors |
| squall_deadlettered_total | counter | source | whoever dead-letters an entry |
| squall_trainer_step | gauge | | trainer: optimizer steps done |

Nothing here imports an HTTP server; `health.start_health_server` serves the registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Rollouts last from a second (a toy task) to tens of minutes (a long agentic episode).
ROLLOUT_BUCKETS_S = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


@dataclass(frozen=True)
class StandardMetrics:
    """The metric objects one process updates; create once per process with `standard_metrics()`."""

    attempts: Counter  # .labels(status=...).inc()
    rollout_seconds: Histogram  # .labels(mode=...).observe(seconds)
    inflight: Gauge  # .set(busy slots)
    tokens: Counter  # .labels(kind="response"|"prompt"|"trained").inc(n)
    tokens_per_second: Gauge  # .labels(service=...).set(rate)
    weight_version: Gauge  # .labels(role="trainer"|"served"|"seen").set(version)
    errors: Counter  # .labels(kind=...).inc()
    deadlettered: Counter  # .labels(source=stream short name).inc()
    trainer_step: Gauge  # .set(step)


_by_registry: dict[int, StandardMetrics] = {}


def standard_metrics(registry: CollectorRegistry | None = None) -> StandardMetrics:
    """The standard metrics registered in `registry` (default: the process-wide one); idempotent."""
    registry = REGISTRY if registry is None else registry
    found = _by_registry.get(id(registry))
    if found is not None:
        return found
    metrics = StandardMetrics(
        attempts=Counter(
            "squall_attempts", "Finished task attempts by status", ["status"], registry=registry
        ),
        rollout_seconds=Histogram(
            "squall_rollout_seconds",
            "Wall time of one attempt, dispatch to trajectory",
            ["mode"],
            buckets=ROLLOUT_BUCKETS_S,
            registry=registry,
        ),
        inflight=Gauge("squall_inflight_attempts", "Attempts running now in this process", registry=registry),
        tokens=Counter("squall_tokens", "Tokens processed, by kind", ["kind"], registry=registry),
        tokens_per_second=Gauge(
            "squall_tokens_per_second", "Recent token throughput", ["service"], registry=registry
        ),
        weight_version=Gauge(
            "squall_weight_version", "Policy weight version this process holds", ["role"], registry=registry
        ),
        errors=Counter("squall_errors", "Errors caught, by kind", ["kind"], registry=registry),
        deadlettered=Counter(
            "squall_deadlettered",
            "Entries sent to deadletter, by source stream",
            ["source"],
            registry=registry,
        ),
        trainer_step=Gauge("squall_trainer_step", "Optimizer steps done", registry=registry),
    )
    _by_registry[id(registry)] = metrics
    return metrics


class QueueCollector(Collector):
    """Queue lag, pending, stream lengths and the ledger, read from Redis at scrape time.

    Register it in the scheduler (the run's owner) so one scrape target shows the whole queue:
    `registry.register(QueueCollector(r, keys))`. A Redis error yields no samples, never raises.
    """

    def __init__(self, r, keys) -> None:  # redis.Redis, shared.keys.Keys
        self.r, self.keys = r, keys

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from squall.shared.runstate import read_ledger, read_streams

        lag = GaugeMetricFamily(
            "squall_queue_lag_entries", "Entries not yet delivered to a group", labels=["stream", "group"]
        )
        pending = GaugeMetricFamily(
            "squall_queue_pending_entries",
            "Entries delivered to a group and not acked",
            labels=["stream", "group"],
        )
        length = GaugeMetricFamily("squall_stream_length_entries", "Entries in a stream", labels=["stream"])
        ledger = GaugeMetricFamily("squall_ledger_attempts", "Attempts per ledger state", labels=["state"])
        balanced = GaugeMetricFamily(
            "squall_ledger_balanced", "1 when every dispatched attempt is in one state"
        )
        infra = GaugeMetricFamily(
            "squall_infra_attempts",
            "Attempts failed because no policy node answered, by what the scheduler did",
            labels=["outcome", "reason"],
        )
        try:  # only the parts of the run state this collector shows, not a whole snapshot
            streams, attempts = read_streams(self.r, self.keys), read_ledger(self.r, self.keys)
            infra_counts = self.r.hgetall(self.keys.infra)
        except Exception:  # a scrape must not fail because Redis is briefly away
            return
        for field, n in infra_counts.items():
            outcome, _, reason = field.decode().partition(":")
            infra.add_metric([outcome, reason], int(n))
        for name, stream in streams.items():
            length.add_metric([name], stream.length)
            for group in stream.groups:
                if group.lag is not None:
                    lag.add_metric([group.stream, group.group], group.lag)
                pending.add_metric([group.stream, group.group], group.pending)
        for state, n in attempts.counts.items():
            ledger.add_metric([state], n)
        balanced.add_metric([], 1.0 if attempts.balanced else 0.0)
        yield from (lag, pending, length, ledger, balanced, infra)

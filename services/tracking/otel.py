"""OpenTelemetry traces of a run, exported over OTLP/HTTP when `tracking.otlp_endpoint` is set.

Off by default: `tracer_for(config, service)` then returns `NO_TRACER`, and nothing of
OpenTelemetry is imported. On, it needs the `otel` extra (opentelemetry-sdk and the OTLP/HTTP
exporter).

What is traced, and how the pieces find each other without any new field on the wire:
- an **attempt** is a trace of its own (root span `attempt`, emitted by the runner when the
  attempt ends) with one child span per **LLM call** (`chat <model>`, GenAI semantic-convention
  attributes: gen_ai.operation.name, gen_ai.request.model, gen_ai.usage.input_tokens/
  output_tokens, gen_ai.response.finish_reasons) at the times the gateway saw the call;
- a **trainer step** is a span linked to the attempt spans of every trajectory it trained;
- a **publication** of weight version V is the root of a trace of its own, linked to the step
  that produced it; each attempt span links to the publication of the version that served it.

The ids of attempt, call and publication spans are derived from the run name and the attempt
key (or the version) by hashing, so the trainer can link to an attempt it only knows by key,
an attempt to a publication it only knows by number, and the gateway can send each call's
`traceparent` upstream before the span exists. An agent's own spans join its attempt through
`attempt_traceparent(key)` (the runner gives it to command agents as `TRACEPARENT`).

An endpoint that is down or refuses: the batch is dropped and counted
(`squall_otel_spans_dropped_total`, and `dropped` here); exporting runs in the SDK's background
thread with a short timeout, so the run itself never waits on it.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Sequence
from typing import Any

EXPORT_TIMEOUT_S = 2.0  # one OTLP request; a dead endpoint costs the background thread this much


def _hash(*parts: Any) -> bytes:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()


def attempt_ids(run: str, key: str) -> tuple[int, int]:
    """(trace id, span id) of an attempt's root span."""
    digest = _hash(run, "attempt", key)
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def call_span_id(run: str, key: str, index: int) -> int:
    return int.from_bytes(_hash(run, "call", key, index)[:8], "big") or 1


def publication_ids(run: str, version: int) -> tuple[int, int]:
    digest = _hash(run, "publication", version)
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


def traceparent(trace_id: int, span_id: int) -> str:
    """The W3C `traceparent` header of a sampled span."""
    return f"00-{trace_id:032x}-{span_id:016x}-01"


class NoTracer:
    """Tracing off: every call does nothing."""

    enabled = False
    dropped = 0

    def attempt(self, *args: Any, **kwargs: Any) -> None: ...
    def trainer_step(self, *args: Any, **kwargs: Any) -> None: ...
    def publication(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self) -> None: ...


NO_TRACER = NoTracer()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Tracer:
    """Spans of one process (`service`: runner | trainer) of run `run`, sent to `endpoint`."""

    enabled = True

    def __init__(self, run: str, service: str, endpoint: str, *, metrics: Any = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
        from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

        self.run, self.dropped = run, 0
        forced: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
            "squall_forced_ids", default=None
        )
        self._forced = forced
        counter = _dropped_counter(metrics) if metrics is not None else None
        owner = self

        class Ids(IdGenerator):
            """Random ids, except the ones `_forced` holds (trace id first, then span id)."""

            random = RandomIdGenerator()

            def generate_trace_id(self) -> int:
                queue = forced.get()
                return queue.pop(0) if queue else self.random.generate_trace_id()

            def generate_span_id(self) -> int:
                queue = forced.get()
                return queue.pop(0) if queue else self.random.generate_span_id()

        class Counting(SpanExporter):
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def export(self, spans: Sequence[Any]) -> Any:
                try:
                    result = self.inner.export(spans)
                except Exception:  # the exporter's own failure: the same as a refused batch
                    result = SpanExportResult.FAILURE
                if result is not SpanExportResult.SUCCESS:
                    owner.dropped += len(spans)
                    if counter is not None:
                        counter.inc(len(spans))
                return result

            def shutdown(self) -> None:
                self.inner.shutdown()

        url = endpoint.rstrip("/") + ("" if endpoint.rstrip("/").endswith("/v1/traces") else "/v1/traces")
        exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        resource = Resource.create({"service.name": f"squall-{service}", "squall.run": run})
        self.provider = TracerProvider(resource=resource, id_generator=Ids())
        self.provider.add_span_processor(BatchSpanProcessor(Counting(exporter), schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("squall")

    def _start(self, name: str, *, ids: list[int] | None = None, parent: Any = None, **kwargs: Any) -> Any:
        from opentelemetry import context, trace

        token = self._forced.set(list(ids or []))
        try:
            ctx = trace.set_span_in_context(parent) if parent is not None else context.Context()
            return self.tracer.start_span(name, context=ctx, **kwargs)
        finally:
            self._forced.reset(token)

    def _link(self, trace_id: int, span_id: int, **attributes: Any) -> Any:
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        ctx = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        return Link(ctx, attributes=attributes)

    def attempt(self, trajectory: Any, started: float, ended: float, call_starts: Sequence[float]) -> None:
        """The attempt's trace: its root span and one span per LLM call (times: unix seconds)."""
        from opentelemetry.trace import Status, StatusCode

        t, key = trajectory, trajectory.key
        versions = sorted({turn.version for turn in t.turns if turn.trained and turn.version >= 0})
        links = [self._link(*publication_ids(self.run, v), **{"squall.weight_version": v}) for v in versions]
        attributes = {
            "squall.run": self.run,
            "squall.attempt": key,
            "squall.group": t.group_id,
            "squall.mode": t.mode,
            "squall.status": t.status,
            "squall.runner": t.runner_id,
            "squall.min_version": t.min_version,
            "squall.weight_versions": versions,
            "squall.turns": len(t.turns),
        }
        if t.reward is not None:
            attributes["squall.reward"] = t.reward
        root = self._start(
            "attempt",
            ids=list(attempt_ids(self.run, key)),
            links=links,
            attributes=attributes,
            start_time=_ns(started),
        )
        if t.status != "ok":
            root.set_status(Status(StatusCode.ERROR, (t.error or t.status)[:200]))
        for i, turn in enumerate(t.turns):
            begin = call_starts[i] if i < len(call_starts) else ended - turn.latency_s
            span = self._start(
                f"chat {turn.model}",
                ids=[call_span_id(self.run, key, i)],
                parent=root,
                start_time=_ns(begin),
                attributes={
                    "gen_ai.operation.name": "chat",
                    "gen_ai.system": "squall",
                    "gen_ai.request.model": turn.model,
                    "gen_ai.usage.input_tokens": len(turn.prompt_ids) // 4,
                    "gen_ai.usage.output_tokens": len(turn.response_ids) // 4,
                    "gen_ai.response.finish_reasons": [turn.finish_reason],
                    "squall.agent": turn.agent,
                    "squall.trained": turn.trained,
                    "squall.weight_version": turn.version,
                    "squall.node": turn.node,
                },
            )
            span.end(end_time=_ns(begin + turn.latency_s))
        root.end(end_time=_ns(ended))

    def trainer_step(
        self, step: int, keys: Sequence[str], started: float, ended: float, published: int | None = None
    ) -> Any:
        """A step that trained the attempts `keys`, linked to each; returns its span context."""
        links = [self._link(*attempt_ids(self.run, key), **{"squall.attempt": key}) for key in keys]
        attributes: dict[str, Any] = {
            "squall.run": self.run,
            "squall.step": step,
            "squall.trajectories": len(keys),
        }
        if published is not None:
            attributes["squall.weight_version"] = published
        span = self._start("trainer step", links=links, attributes=attributes, start_time=_ns(started))
        span.end(end_time=_ns(ended))
        return span.get_span_context()

    def publication(
        self, version: int, step: int, started: float, ended: float, step_context: Any = None
    ) -> None:
        """Version `version` published: the root of its own trace, linked to the step that made it."""
        links = []
        if step_context is not None:
            links.append(self._link(step_context.trace_id, step_context.span_id, **{"squall.step": step}))
        span = self._start(
            "publish weights",
            ids=list(publication_ids(self.run, version)),
            links=links,
            attributes={"squall.run": self.run, "squall.weight_version": version, "squall.step": step},
            start_time=_ns(started),
        )
        span.end(end_time=_ns(ended))

    def close(self) -> None:
        """Send what is queued (bounded by the exporter's timeout), then stop."""
        self.provider.force_flush(timeout_millis=int(EXPORT_TIMEOUT_S * 2000))
        self.provider.shutdown()


_counters: dict[int, Any] = {}


def _dropped_counter(registry: Any) -> Any:
    """`squall_otel_spans_dropped_total` in `registry`, created once per registry."""
    from prometheus_client import Counter

    if id(registry) not in _counters:
        _counters[id(registry)] = Counter(
            "squall_otel_spans_dropped", "Spans the OTLP endpoint did not take", registry=registry
        )
    return _counters[id(registry)]


def tracer_for(config: Any, service: str, *, metrics: Any = None) -> NoTracer | Tracer:
    """The process's tracer: NO_TRACER unless `tracking.otlp_endpoint` is set."""
    endpoint = config.tracking.otlp_endpoint
    if not endpoint:
        return NO_TRACER
    return Tracer(config.run.name, service, endpoint, metrics=metrics)

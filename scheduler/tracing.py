"""OpenTelemetry tracing for both processes: set up once at start, free when off.

On when `--otlp-endpoint` or the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable is
set; the exporter speaks OTLP over gRPC or HTTP (`--otlp-protocol`, or
OTEL_EXPORTER_OTLP_PROTOCOL). Sampling is parent-based: a request that arrives with a W3C
`traceparent` follows its caller's decision; others are sampled at `--trace-sample-ratio`.
When off, `enabled()` is False and callers create no spans at all.

Across ZeroMQ the scheduler sends, per sequence in a Step, the `traceparent` of the span that
sequence's work belongs to (a prefill chunk or the decode phase); the worker's step span is a
child of the first and links to all of them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Link, Span, SpanContext, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

SCHEDULER_SERVICE = "duoserve-scheduler"
WORKER_SERVICE = "duoserve-worker"
PROTOCOLS = ("grpc", "http/protobuf")

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def endpoint_from_env() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def setup(service_name: str, endpoint: str, protocol: str, sample_ratio: float) -> bool:
    """Install an OTLP-exporting tracer provider; returns whether tracing is on."""
    global _tracer, _provider
    endpoint = endpoint or endpoint_from_env()
    if not endpoint:
        _tracer = _provider = None
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    protocol = protocol or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if endpoint.endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        exporter = HttpExporter(endpoint=url)
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("duoserve")
    log.info("tracing to %s over %s as %s, sample ratio %g", endpoint, protocol, service_name, sample_ratio)
    return True


def shutdown() -> None:
    """Export what is still buffered (on a clean exit) and turn tracing off."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def tracer() -> Tracer:
    assert _tracer is not None, "tracing is off"
    return _tracer


def extract(headers: Iterable[tuple[str, str | bytes]]) -> Context:
    """The caller's context from gRPC metadata (traceparent / tracestate), or an empty one."""
    carrier = {key.lower(): value.decode() if isinstance(value, bytes) else value for key, value in headers}
    return _propagator.extract(carrier)


def traceparent(span: Span) -> str:
    """The W3C traceparent naming `span`, for the worker to link to."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def span_context(header: str) -> SpanContext | None:
    context = trace.get_current_span(_propagator.extract({"traceparent": header})).get_span_context()
    return context if context.is_valid else None


def links_and_parent(headers: Mapping[int, str]) -> tuple[Context | None, list[Link]]:
    """The worker step span's parent (the first sequence's span) and links to every sequence's span."""
    contexts = [c for c in (span_context(h) for h in headers.values()) if c is not None]
    if not contexts:
        return None, []
    parent = trace.set_span_in_context(trace.NonRecordingSpan(contexts[0]))
    return parent, [Link(c) for c in contexts]


class RequestTrace:
    """The spans of one traced request below its gRPC server span.

    queue (arrival to first step; again after each preemption), one span per prefill chunk
    (dispatch to result), one decode span for the whole decode phase (events, not a span per
    token); usage and timings land on the server span when the request ends.
    """

    def __init__(self, root: Span, model: str) -> None:
        self.root = root
        self.model = model
        self._parent = trace.set_span_in_context(root)
        self._queue: Span | None = tracer().start_span("queue", context=self._parent)
        self._chunks: dict[int, Span] = {}  # step_id -> prefill chunk span
        self._decode: Span | None = None
        self.queue_seconds = 0.0
        self._queued_since = time.monotonic()

    def step_started(
        self, step_id: int, lane: int, num_tokens: int, start_position: int, prefill: bool
    ) -> str:
        """The request's work joined step `step_id`; returns the traceparent the worker links to."""
        if self._queue is not None:
            self._queue.end()
            self._queue = None
            self.queue_seconds += time.monotonic() - self._queued_since
        if prefill:
            span = tracer().start_span(
                "prefill",
                context=self._parent,
                attributes={
                    "duoserve.step_id": step_id,
                    "duoserve.lane": lane,
                    "duoserve.chunk.tokens": num_tokens,
                    "duoserve.chunk.start_position": start_position,
                },
            )
            self._chunks[step_id] = span
            return traceparent(span)
        if self._decode is None:
            self._decode = tracer().start_span("decode", context=self._parent)
        return traceparent(self._decode)

    def step_finished(self, step_id: int) -> None:
        span = self._chunks.pop(step_id, None)
        if span is not None:
            span.end()

    def preempted(self, num_computed: int) -> None:
        (self._decode or self.root).add_event("preempted", {"duoserve.recompute_tokens": num_computed})
        for span in self._chunks.values():
            span.end()
        self._chunks.clear()
        if self._queue is None:
            self._queue = tracer().start_span(
                "queue", context=self._parent, attributes={"duoserve.requeued": True}
            )
            self._queued_since = time.monotonic()

    def token(self, index: int) -> None:
        if index == 0:  # sampled at the end of the last prefill chunk, before any decode
            self.root.add_event("first_token")

    def finish(
        self,
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        ttft_seconds: float | None,
        finish_reason: str,
        preemptions: int,
    ) -> None:
        """End every child span and put the usage on the server span (which the servicer ends)."""
        for span in (self._queue, *self._chunks.values(), self._decode):
            if span is not None:
                span.end()
        self._queue, self._decode = None, None
        self._chunks.clear()
        attributes: dict[str, str | int | float] = {
            "gen_ai.request.model": self.model,
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "duoserve.usage.cached_prompt_tokens": cached_tokens,
            "duoserve.queue_seconds": self.queue_seconds,
            "duoserve.finish_reason": finish_reason,
            "duoserve.preemptions": preemptions,
        }
        if ttft_seconds is not None:
            attributes["duoserve.time_to_first_token_seconds"] = ttft_seconds
        self.root.set_attributes(attributes)

"""Tracing setup: off without an endpoint, parent-based sampling at --trace-sample-ratio."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace

from scheduler import tracing


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown()


def test_tracing_is_off_without_an_endpoint(no_otel_env: None) -> None:
    assert tracing.setup("duoserve-scheduler", "", "", 1.0) is False
    assert not tracing.enabled()


def test_the_standard_variable_turns_it_on(no_otel_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert tracing.setup("duoserve-scheduler", "", "", 1.0) is True and tracing.enabled()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sampling_follows_the_caller_and_else_the_ratio(no_otel_env: None, protocol: str) -> None:
    # Nothing is exported here: spans are only created and ended (the exporter never connects).
    assert tracing.setup("duoserve-scheduler", "http://127.0.0.1:9", protocol, 0.0)
    tracer = tracing.tracer()
    assert not tracer.start_span("unsampled root").is_recording()  # ratio 0, no caller
    sampled = trace.SpanContext(1, 2, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    child = tracer.start_span("child", context=trace.set_span_in_context(trace.NonRecordingSpan(sampled)))
    assert child.is_recording()  # the caller sampled it: followed whatever the ratio
    header = tracing.traceparent(child)
    assert header.startswith("00-00000000000000000000000000000001-")
    context = tracing.span_context(header)
    assert context is not None and context.span_id == child.get_span_context().span_id
    parent, links = tracing.links_and_parent({7: header, 9: "garbage"})
    assert parent is not None and [link.context.span_id for link in links] == [context.span_id]
    # Never ended, so never exported: shutting down does not wait on the unreachable endpoint.

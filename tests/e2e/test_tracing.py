"""Tracing end to end: a real OTLP/gRPC receiver on loopback gets the spans of both processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from duoserve_client import Client
from tests.e2e.harness import ServerProcess, free_port, start_server

pytestmark = pytest.mark.slow

CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331


@dataclass
class Span:
    service: str
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    attributes: dict[str, Any]
    links: list[tuple[int, int]]
    events: list[str]


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The OpenTelemetry collector's TraceService: keeps every span it is sent."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            Span(
                                service=service,
                                name=s.name,
                                trace_id=int.from_bytes(s.trace_id, "big"),
                                span_id=int.from_bytes(s.span_id, "big"),
                                parent_span_id=int.from_bytes(s.parent_span_id, "big")
                                if s.parent_span_id
                                else None,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                links=[
                                    (int.from_bytes(k.trace_id, "big"), int.from_bytes(k.span_id, "big"))
                                    for k in s.links
                                ],
                                events=[e.name for e in s.events],
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: int) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    service = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield service, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def traced_server(receiver: tuple[Receiver, int]) -> Iterator[ServerProcess]:
    _, port = receiver
    server = start_server(
        "--dtype",
        "float32",
        "--metrics-port",
        "0",
        "--otlp-endpoint",
        f"http://127.0.0.1:{port}",
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export every 0.1 s instead of 5 s
    )
    yield server
    assert server.stop() == 0


def wait_for(receiver: Receiver, trace_id: int, ready: Any, timeout: float = 30.0) -> list[Span]:
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.of_trace(trace_id)
        if ready(spans):
            return spans
        assert time.monotonic() < deadline, f"spans of trace {trace_id:x} never completed: {spans}"
        time.sleep(0.1)


def test_one_request_is_one_trace_across_scheduler_and_worker(
    receiver: tuple[Receiver, int], traced_server: ServerProcess
) -> None:
    spans_in, _ = receiver
    caller = trace.SpanContext(
        CLIENT_TRACE_ID,
        CLIENT_SPAN_ID,
        is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
    )
    token = otel_context.attach(trace.set_span_in_context(trace.NonRecordingSpan(caller)))
    try:
        with Client(traced_server.target) as client:  # the SDK sends the caller's traceparent
            completion = client.generate("Once upon a time", max_tokens=6, ignore_eos=True)
    finally:
        otel_context.detach(token)

    def complete(spans: list[Span]) -> bool:
        # The worker exports its spans in batches of its own: wait for all six steps, not the first.
        names = {s.name for s in spans}
        steps = sum(s.name == "worker.step" for s in spans)
        return {"duoserve.v1.Inference/Generate", "queue", "prefill", "decode"} <= names and steps >= 6

    spans = wait_for(spans_in, CLIENT_TRACE_ID, complete)
    (root,) = [s for s in spans if s.name == "duoserve.v1.Inference/Generate"]
    assert root.service == "duoserve-scheduler"
    assert root.parent_span_id == CLIENT_SPAN_ID  # the caller's trace is continued
    assert root.attributes["gen_ai.request.model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert root.attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == 6
    assert root.attributes["duoserve.time_to_first_token_seconds"] > 0
    assert root.attributes["duoserve.queue_seconds"] >= 0
    children = [s for s in spans if s.service == "duoserve-scheduler" and s is not root]
    assert {s.name for s in children} == {"queue", "prefill", "decode"}
    assert all(s.parent_span_id == root.span_id for s in children)
    assert "first_token" in root.events
    request_spans = {s.span_id for s in children if s.name in ("prefill", "decode")}
    steps = [s for s in spans if s.service == "duoserve-worker"]
    # One prefill step and five decode steps, each a child of (and linked to) the span it served.
    assert len(steps) == 6 and all(s.name == "worker.step" for s in steps)
    for step in steps:
        assert step.parent_span_id in request_spans
        assert (CLIENT_TRACE_ID, step.parent_span_id) in step.links
        assert step.attributes["duoserve.batch.tokens"] >= 1
        assert step.attributes["duoserve.step.compute_seconds"] > 0
        assert (
            0
            < step.attributes["duoserve.step.sampling_seconds"]
            < step.attributes["duoserve.step.compute_seconds"]
        )
    prefill_steps = [s for s in steps if s.attributes["duoserve.batch.prefill_tokens"] > 0]
    assert (
        len(prefill_steps) == 1
        and prefill_steps[0].attributes["duoserve.batch.prefill_tokens"] == completion.usage.prompt_tokens
    )


def test_a_request_without_a_caller_context_starts_its_own_trace(
    receiver: tuple[Receiver, int], traced_server: ServerProcess
) -> None:
    spans_in, _ = receiver
    with Client(traced_server.target) as client:
        stream = list(client.stream("Hello", max_tokens=2, ignore_eos=True))
    assert stream[-1].finish_reason == "length"
    deadline = time.monotonic() + 30
    while True:
        with spans_in.lock:
            roots = [s for s in spans_in.spans if s.name == "duoserve.v1.Inference/GenerateStream"]
        if roots:
            break
        assert time.monotonic() < deadline, "no GenerateStream span arrived"
        time.sleep(0.1)
    (root,) = roots
    assert root.parent_span_id is None and root.trace_id != CLIENT_TRACE_ID
    spans = wait_for(spans_in, root.trace_id, lambda s: any(x.service == "duoserve-worker" for x in s))
    assert any(s.name == "decode" for s in spans)


def test_otlp_over_http_set_by_the_standard_variables() -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT / _PROTOCOL instead of flags, and OTLP/HTTP instead of gRPC."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces"
            receiver.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(body), None)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{http.server_address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    server = start_server("--dtype", "float32", "--metrics-port", "0", env=env)
    try:
        with Client(server.target) as client:
            client.generate("Hi", max_tokens=3, ignore_eos=True)
        deadline = time.monotonic() + 30
        while True:
            with receiver.lock:
                roots = [s for s in receiver.spans if s.name == "duoserve.v1.Inference/Generate"]
                services = {s.service for s in receiver.spans}
            if roots and services == {"duoserve-scheduler", "duoserve-worker"}:
                break
            assert time.monotonic() < deadline, f"spans never arrived over HTTP: {receiver.spans}"
            time.sleep(0.1)
        (root,) = roots
        assert root.attributes["gen_ai.usage.output_tokens"] == 3
    finally:
        assert server.stop() == 0
        http.shutdown()

"""The caller's OpenTelemetry context as W3C headers (traceparent, tracestate) for a call's metadata.

The SDK depends on grpcio and protobuf only: without `opentelemetry-api` installed, or with no
active span, nothing is added and the server starts a trace of its own.
"""

from __future__ import annotations

from collections.abc import Sequence


def with_trace_context(metadata: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    try:
        from opentelemetry import propagate
    except ImportError:
        return tuple(metadata)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*metadata, *carrier.items())

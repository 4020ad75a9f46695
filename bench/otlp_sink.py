"""A minimal OTLP/gRPC trace receiver for benchmarks: accepts spans, counts them, keeps nothing.

    python bench/otlp_sink.py --port 4317 &
    python bench/serving.py --configs dtype=bfloat16 "dtype=bfloat16,otlp-endpoint=http://127.0.0.1:4317"

Prints the running span count per service every 10 s and at exit (Ctrl-C).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "?",
                )
                self.counts[service] += sum(len(scope.spans) for scope in resource_spans.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args(argv)
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"# OTLP sink on 127.0.0.1:{args.port}", flush=True)
    try:
        while True:
            time.sleep(10)
            print(f"# spans so far: {dict(sink.counts)}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        print(f"# spans received: {dict(sink.counts)}", flush=True)
        server.stop(grace=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

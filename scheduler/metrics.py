"""Per-request Prometheus metrics, recorded once when a request ends.

Gauges of queues, KV blocks and worker time are read from the engine at scrape time
(http_server.EngineCollector); these are the histograms and counters that need events.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from scheduler.request import Request

# Seconds; CPU serving spans milliseconds (a decode step) to minutes (a long queue).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "duoserve_requests",
            "Finished generation requests by finish reason and gRPC status code",
            ["finish_reason", "code"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "duoserve_prompt_tokens", "Prompt tokens of finished requests", registry=registry
        )
        self.generation_tokens = Counter(
            "duoserve_generation_tokens", "Tokens generated for finished requests", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            "duoserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=registry
        )
        self.ttft = Histogram(
            "duoserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tpot = Histogram(
            "duoserve_time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            buckets=TOKEN_TIME_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "duoserve_queue_time_seconds", "Arrival to first step", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.e2e = Histogram(
            "duoserve_e2e_request_latency_seconds",
            "Arrival to the end",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def record(self, request: Request, code: str) -> None:
        """Count one request that ended with gRPC status `code` (OK, or the error's name)."""
        now = time.monotonic()
        reason = request.finish_reason.name.lower() if request.finish_reason is not None else "none"
        self.requests.labels(finish_reason=reason, code=code).inc()
        outputs = len(request.output_token_ids)
        self.prompt_tokens.inc(request.prompt_len)
        self.generation_tokens.inc(outputs)
        self.cached_prompt_tokens.inc(request.num_cached_prompt_tokens)
        self.e2e.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
            if outputs > 1:
                self.tpot.observe((now - request.first_token_time) / (outputs - 1))

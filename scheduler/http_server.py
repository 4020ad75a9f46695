"""HTTP `/health` and `/metrics` (Prometheus) next to the gRPC API, for probes and scrapers.

Gauges are read from the engine when scraped, so serving pays nothing for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.engine import Engine

log = logging.getLogger(__name__)


class EngineCollector(Collector):
    """Queue, KV-cache and batch gauges of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine = self.engine
        queue = GaugeMetricFamily("duoserve_queue_size", "Requests by queue", labels=["queue"])
        blocks = GaugeMetricFamily("duoserve_kv_cache_blocks", "KV-cache blocks by state", labels=["state"])
        utilization = GaugeMetricFamily("duoserve_kv_cache_utilization", "Fraction of KV-cache blocks in use")
        active = GaugeMetricFamily("duoserve_active_batches", "Batches in flight on the worker")
        hit_ratio = GaugeMetricFamily(
            "duoserve_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache / prompt tokens admitted",
        )
        if engine.planner is not None and engine.blocks is not None:
            queue.add_metric(["waiting"], len(engine.planner.waiting))
            queue.add_metric(["running"], len(engine.planner.running))
            free, total = engine.blocks.num_free_blocks, engine.blocks.num_blocks
            cached = engine.blocks.num_cached_blocks
            blocks.add_metric(["free"], free - cached)
            blocks.add_metric(["cached"], cached)
            blocks.add_metric(["used"], total - free)
            utilization.add_metric([], (total - free) / total)
            hit_ratio.add_metric([], engine.planner.prefix_hit_ratio)
        active.add_metric([], engine.num_inflight_batches)
        preemptions = CounterMetricFamily(
            "duoserve_preemptions", "Running requests preempted for KV blocks", value=engine.num_preemptions
        )
        urgent = CounterMetricFamily(
            "duoserve_urgent_steps",
            "Steps of interactive prompts run inside the batch in progress",
            value=engine.num_urgent_steps,
        )
        times = engine.worker_times
        worker = (
            CounterMetricFamily("duoserve_worker_busy_seconds", "Worker compute time", value=times.busy),
            CounterMetricFamily(
                "duoserve_worker_sampling_seconds",
                "Of the worker's compute time, the sampler's (temperature, filters, draws, logprobs)",
                value=times.sampling,
            ),
            CounterMetricFamily(
                "duoserve_worker_wait_seconds", "Worker idle time while work was in flight", value=times.wait
            ),
            CounterMetricFamily(
                "duoserve_worker_staging_seconds", "Worker input staging time", value=times.staging
            ),
            CounterMetricFamily(
                "duoserve_worker_exposed_staging_seconds",
                "Staging time not hidden behind compute",
                value=times.exposed_staging,
            ),
            CounterMetricFamily(
                "duoserve_worker_exposed_staging_full_seconds",
                "Of the exposed staging, that of steps staged in full on arrival (new prompts, or not as forecast)",
                value=times.exposed_staging_full,
            ),
            CounterMetricFamily("duoserve_worker_steps", "Steps the worker executed", value=times.steps),
            CounterMetricFamily(
                "duoserve_worker_decode_busy_seconds",
                "Of the worker's compute time, that of decode steps (every sequence one token)",
                value=times.decode_busy,
            ),
            CounterMetricFamily(
                "duoserve_worker_decode_steps",
                "Of the steps, the decode steps (every sequence one token)",
                value=times.decode_steps,
            ),
            CounterMetricFamily(
                "duoserve_worker_forecast_steps",
                "Steps the worker staged from its forecast of them, built while the step before computed",
                value=times.forecast_steps,
            ),
            GaugeMetricFamily(
                "duoserve_worker_idle_ratio",
                "Worker wait / (wait + busy) over the last 10 s of steps",
                value=times.idle_ratio(),
            ),
        )
        yield from (queue, blocks, utilization, active, hit_ratio, preemptions, urgent, *worker)


def _handler(registry: CollectorRegistry, is_ready: Callable[[], bool]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/health":
                ready = is_ready()
                self._reply(200 if ready else 503, b"ok\n" if ready else b"not ready\n", "text/plain")
            else:
                self._reply(404, b"not found: try /health or /metrics\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


class HttpEndpoint:
    """Serves /health and /metrics on a background thread."""

    def __init__(
        self, host: str, port: int, engine: Engine, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self._server = ThreadingHTTPServer((host, port), _handler(self.registry, lambda: engine.ready))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="duoserve-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

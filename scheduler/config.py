"""The scheduler process's configuration: one frozen dataclass, validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.curve import faces_network

VALID_BLOCK_SIZES = (8, 16, 32)
MAX_INFLIGHT_LIMIT = 4
MAX_STREAM_INTERVAL = 256


class ConfigError(ValueError):
    """A flag has a bad value; the message names the flag and the allowed range."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    model: str
    host: str = "localhost"
    port: int = 50051
    metrics_port: int = 9400
    worker_address: str = ""
    num_workers: int = 1
    block_size: int = 16
    num_kv_blocks: int = 0
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_chunk: int = 512
    dbo: bool = True  # False: one batch in flight, whatever max_inflight says
    max_inflight: int = 2
    min_lane_seqs: int = 0  # 0 = by the worker's device (see lane_min_seqs)
    prefix_cache: bool = True
    urgent_steps: bool = True  # interactive prefills interrupt the step in progress at a layer boundary
    lookahead: bool = True  # with DBO: a sequence's next step goes out while its current one computes
    max_queued_requests: int = 1024
    max_queued_tokens: int = 262144
    prefill_window_ms: float = 0.0
    default_max_tokens: int = 256
    stream_interval: int = 1  # tokens a streamed chunk carries after the first
    drain_timeout: float = 10.0
    worker_timeout: float = 5.0  # no heartbeat for this long: the worker is lost
    step_timeout: float = 300.0  # a step unanswered for this long: the worker is hung
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    api_key_file: str = ""
    zmq_curve_secret: str = ""
    zmq_curve_authorized: str = ""
    restart_workers: bool = True  # wait for a replacement worker and re-admit the affected requests
    max_worker_restarts: int = 5
    worker_restart_timeout: float = 300.0  # no replacement ready within this: give up
    otlp_endpoint: str = ""
    otlp_protocol: str = ""  # "" = $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc
    trace_sample_ratio: float = 1.0

    @property
    def lanes(self) -> int:
        """Batches kept in flight at once: --max-inflight with DBO, one with --no-dbo."""
        return self.max_inflight if self.dbo else 1

    def __post_init__(self) -> None:
        check_flag(1 <= self.port <= 65535, "--port", self.port, "1..65535")
        check_flag(
            0 <= self.metrics_port <= 65535,
            "--metrics-port",
            self.metrics_port,
            "0..65535 (0 = any free port)",
        )
        check_flag(
            self.num_workers == 1,
            "--num-workers",
            self.num_workers,
            "1 (data-parallel groups are not built yet)",
        )
        check_flag(self.block_size in VALID_BLOCK_SIZES, "--block-size", self.block_size, "one of 8, 16, 32")
        check_flag(
            self.num_kv_blocks >= 0, "--num-kv-blocks", self.num_kv_blocks, ">= 0 (0 = as many as fit)"
        )
        check_flag(self.max_batched_tokens >= 1, "--max-batched-tokens", self.max_batched_tokens, ">= 1")
        check_flag(self.max_num_seqs >= 1, "--max-num-seqs", self.max_num_seqs, ">= 1")
        check_flag(self.prefill_chunk >= 1, "--prefill-chunk", self.prefill_chunk, ">= 1")
        check_flag(
            1 <= self.max_inflight <= MAX_INFLIGHT_LIMIT,
            "--max-inflight",
            self.max_inflight,
            f"1..{MAX_INFLIGHT_LIMIT}",
        )
        check_flag(self.min_lane_seqs >= 0, "--min-lane-seqs", self.min_lane_seqs, ">= 0 (0 = by device)")
        check_flag(self.max_queued_requests >= 1, "--max-queued-requests", self.max_queued_requests, ">= 1")
        check_flag(self.max_queued_tokens >= 1, "--max-queued-tokens", self.max_queued_tokens, ">= 1")
        check_flag(
            0 <= self.prefill_window_ms <= 10_000, "--prefill-window-ms", self.prefill_window_ms, "0..10000"
        )
        check_flag(self.default_max_tokens >= 1, "--default-max-tokens", self.default_max_tokens, ">= 1")
        check_flag(
            1 <= self.stream_interval <= MAX_STREAM_INTERVAL,
            "--stream-interval",
            self.stream_interval,
            f"1..{MAX_STREAM_INTERVAL}",
        )
        check_tracing_flags(self.otlp_protocol, self.trace_sample_ratio)
        check_flag(self.worker_timeout > 0, "--worker-timeout", self.worker_timeout, "> 0 seconds")
        check_flag(self.step_timeout > 0, "--step-timeout", self.step_timeout, "> 0 seconds")
        check_flag(self.max_worker_restarts >= 0, "--max-worker-restarts", self.max_worker_restarts, ">= 0")
        check_flag(
            self.worker_restart_timeout > 0,
            "--worker-restart-timeout",
            self.worker_restart_timeout,
            "> 0 seconds",
        )
        check_flag(self.drain_timeout >= 0, "--drain-timeout", self.drain_timeout, ">= 0")
        check_flag(
            bool(self.zmq_curve_secret) == bool(self.zmq_curve_authorized),
            "--zmq-curve-secret",
            self.zmq_curve_secret,
            "given together with --zmq-curve-authorized",
        )
        check_flag(
            not faces_network(self.worker_address) or bool(self.zmq_curve_secret),
            "--worker-address",
            self.worker_address,
            "ipc://, tcp:// on loopback, or a network-facing tcp:// with CURVE keys "
            "(--zmq-curve-secret, --zmq-curve-authorized; `duoserve keys DIR` makes them)",
        )
        check_flag(
            self.worker_address.startswith(("ipc://", "tcp://")),
            "--worker-address",
            self.worker_address,
            "an ipc:// or tcp:// address",
        )

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.port}"

    def lane_min_seqs(self, worker_device: str) -> int:
        """Fewest sequences (running or waiting) DBO dispatches as a batch of their own.

        Every step pays a fixed cost (weights read once, per-op overheads). On a CPU worker that
        cost is about the compute of 30-40 decodes (SmolLM2-135M, bfloat16, 2 cores) and far more
        than the scheduler time a second batch in flight hides, so by default a CPU worker gets
        one batch at a time unless `max_num_seqs` sequences are free to form another. On a GPU
        the running set is split evenly between the lanes.
        """
        if self.min_lane_seqs:
            return self.min_lane_seqs
        return self.max_num_seqs if worker_device.startswith("cpu") else 1

    @property
    def prefill_token_budget(self) -> int:
        """Tokens one prefill chunk may take in a step."""
        return min(self.prefill_chunk, self.max_batched_tokens)


def check_flag(
    ok: bool, flag: str, value: object, allowed: str, error: type[ConfigError] = ConfigError
) -> None:
    """Raise `error` naming the flag, its value and what is allowed, unless `ok`."""
    if not ok:
        raise error(f"{flag}={value!r} is invalid: allowed {allowed}")


def check_tracing_flags(
    otlp_protocol: str, trace_sample_ratio: float, error: type[ConfigError] = ConfigError
) -> None:
    """The tracing flags every process takes (scheduler and worker alike)."""
    check_flag(
        otlp_protocol in ("", "grpc", "http/protobuf"),
        "--otlp-protocol",
        otlp_protocol,
        "grpc, http/protobuf (empty: from $OTEL_EXPORTER_OTLP_PROTOCOL)",
        error,
    )
    check_flag(0.0 <= trace_sample_ratio <= 1.0, "--trace-sample-ratio", trace_sample_ratio, "0..1", error)

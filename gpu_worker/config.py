"""The worker process's configuration: one frozen dataclass, validated at start."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.config import ConfigError, check_flag, check_tracing_flags
from scheduler.curve import faces_network

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
DENSE_WEIGHTS = ("auto", "keep", "drop")
# auto: the model's dtype; int8: rows and a scale each (kernels/kv_int8.py)
KV_CACHE_DTYPES = ("auto", "int8")

# A worker's exit code when it cannot start with this model and these settings (a model file it
# cannot load, a device or dtype this machine lacks): starting it again would fail the same way,
# so `duoserve serve` stops instead of restarting it.
CANNOT_START = 3


class WorkerConfigError(ConfigError):
    """A worker flag has a bad value; the message names the flag and the allowed range."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    model: str
    scheduler_address: str
    worker_id: int = 0
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    kv_cache_memory: float = 0.0
    kv_cache_dtype: str = "auto"
    threads: int = 0
    sbo: bool = True
    sbo_depth: int = 2
    compute_streams: int = 1
    sbo_switch_interval_ms: float = 0.2
    sbo_threads: bool = False  # CUDA: SBO on three threads, not one
    cuda_graphs: bool = True
    cuda_graph_max_batch: int = 256
    small_batch_linear: bool = True
    block_linear: bool = True
    dense_weights: str = "auto"
    cpu_vector_bits: int = 512
    huge_pages: bool = True
    omp_spin_count: int = 1000  # gpu_worker/thread_waits.py
    seed: int = 0
    zmq_curve_worker_secret: str = ""
    zmq_curve_server_key: str = ""
    otlp_endpoint: str = ""
    otlp_protocol: str = ""  # "" = $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc
    trace_sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "--dtype", self.dtype, ", ".join(DTYPES))
        _check(self.device in DEVICES, "--device", self.device, ", ".join(DEVICES))
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            "--attention-backend",
            self.attention_backend,
            ", ".join(ATTENTION_BACKENDS),
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            ", ".join(KV_CACHE_DTYPES),
        )
        _check(
            self.dense_weights in DENSE_WEIGHTS,
            "--dense-weights",
            self.dense_weights,
            ", ".join(DENSE_WEIGHTS),
        )
        _check(
            self.dense_weights != "drop" or self.block_linear,
            "--dense-weights",
            self.dense_weights,
            "keep or auto with --no-block-linear (drop multiplies on the blocks that flag turns off)",
        )
        _check(
            0.0 <= self.kv_cache_memory <= 0.95,
            "--kv-cache-memory",
            self.kv_cache_memory,
            "a fraction of free device memory in [0, 0.95] (0 = the device's default)",
        )
        check_tracing_flags(self.otlp_protocol, self.trace_sample_ratio, WorkerConfigError)
        _check(self.threads >= 0, "--threads", self.threads, ">= 0 (0 = all cores)")
        _check(1 <= self.sbo_depth <= 4, "--sbo-depth", self.sbo_depth, "1 to 4")
        _check(1 <= self.compute_streams <= 4, "--compute-streams", self.compute_streams, "1 to 4")
        _check(
            0.01 <= self.sbo_switch_interval_ms <= 100,
            "--sbo-switch-interval-ms",
            self.sbo_switch_interval_ms,
            "0.01 to 100 milliseconds",
        )
        _check(
            1 <= self.cuda_graph_max_batch <= 1024,
            "--cuda-graph-max-batch",
            self.cuda_graph_max_batch,
            "1 to 1024",
        )
        _check(self.worker_id >= 0, "--worker-id", self.worker_id, ">= 0")
        _check(
            0 <= self.omp_spin_count <= 2**31 - 1,
            "--omp-spin-count",
            self.omp_spin_count,
            "0 to 2147483647 (0 = sleep at once)",
        )
        _check(
            self.cpu_vector_bits in (512, 256, 0), "--cpu-vector-bits", self.cpu_vector_bits, "512, 256 or 0"
        )
        _check(
            bool(self.zmq_curve_worker_secret) == bool(self.zmq_curve_server_key),
            "--zmq-curve-worker-secret",
            self.zmq_curve_worker_secret,
            "given together with --zmq-curve-server-key",
        )
        _check(
            not faces_network(self.scheduler_address) or bool(self.zmq_curve_worker_secret),
            "--scheduler-address",
            self.scheduler_address,
            "ipc://, tcp:// on loopback, or a network-facing tcp:// with CURVE keys "
            "(--zmq-curve-worker-secret, --zmq-curve-server-key; `duoserve keys DIR` makes them)",
        )
        _check(
            self.scheduler_address.startswith(("ipc://", "tcp://")),
            "--scheduler-address",
            self.scheduler_address,
            "an ipc:// or tcp:// address",
        )


def _check(ok: bool, flag: str, value: object, allowed: str) -> None:
    check_flag(ok, flag, value, allowed, WorkerConfigError)

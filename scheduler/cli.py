"""The `duoserve` command: `serve` (scheduler + workers), `scheduler`, `worker`.

Every flag can also be set by an environment variable named after it
(`--max-inflight` -> `DUOSERVE_MAX_INFLIGHT`); a flag on the command line wins.
The worker's modules (torch) are imported only by the `worker` subcommand, so
the scheduler process stays light.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from scheduler.config import ConfigError, SchedulerConfig
from scheduler.model_files import ModelNotFoundError, find_default_model

log = logging.getLogger("duoserve")

ENV_PREFIX = "DUOSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # "--max-inflight"
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


COMMON_FLAGS = (
    Flag("--model", str, "", "GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct)"),
    Flag("--log-level", str, "info", "logging level", ("debug", "info", "warning", "error")),
)
TRACING_FLAGS = (
    Flag(
        "--otlp-endpoint",
        str,
        "",
        "OTLP collector for traces, e.g. http://localhost:4317 (default: $OTEL_EXPORTER_OTLP_ENDPOINT; unset = off)",
    ),
    Flag(
        "--otlp-protocol",
        str,
        "",
        "OTLP transport (default: $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)",
        ("", "grpc", "http/protobuf"),
    ),
    Flag("--trace-sample-ratio", float, 1.0, "share of requests traced when the caller sent no traceparent"),
)
SCHEDULER_FLAGS = (
    Flag("--host", str, "localhost", "gRPC listen host"),
    Flag("--port", int, 50051, "gRPC listen port"),
    Flag("--tls-cert", str, "", "PEM certificate chain: serve gRPC over TLS (with --tls-key)"),
    Flag("--tls-key", str, "", "PEM private key of --tls-cert"),
    Flag("--tls-client-ca", str, "", "PEM CA: require client certificates it signed (mutual TLS)"),
    Flag(
        "--api-key-file", str, "", "file of API keys, one per line: calls need 'authorization: Bearer <key>'"
    ),
    Flag("--zmq-curve-secret", str, "", "CURVE: the scheduler's secret key file (from `duoserve keys DIR`)"),
    Flag("--zmq-curve-authorized", str, "", "CURVE: directory of the worker public keys to accept"),
    Flag("--metrics-port", int, 9400, "HTTP port of /health and /metrics (same host as gRPC)"),
    Flag("--worker-address", str, "", "ZeroMQ address workers connect to (default: an ipc:// socket)"),
    Flag("--num-workers", int, 1, "worker processes"),
    Flag("--block-size", int, 16, "tokens per KV-cache block (8, 16 or 32)"),
    Flag("--num-kv-blocks", int, 0, "cap on KV-cache blocks (0 = as many as the memory budget allows)"),
    Flag("--max-batched-tokens", int, 2048, "token budget of one step"),
    Flag("--max-num-seqs", int, 256, "sequences in one step"),
    Flag("--prefill-chunk", int, 512, "longest prefill chunk of one sequence in one step"),
    Flag("--dbo", bool, True, "dual batch overlap: keep --max-inflight batches in flight (--no-dbo: one)"),
    Flag("--max-inflight", int, 2, "batches in flight at once with DBO (1 also turns it off)"),
    Flag(
        "--min-lane-seqs",
        int,
        0,
        "fewest running sequences DBO puts in one lane (0 = by device: CPU keeps decodes in one lane)",
    ),
    Flag(
        "--lookahead",
        bool,
        True,
        "with DBO: send a sequence's next step while its current one computes, where the worker takes it",
    ),
    Flag("--prefix-cache", bool, True, "reuse the KV blocks of cached prompt prefixes"),
    Flag(
        "--urgent-steps",
        bool,
        True,
        "run interactive prefills at the next layer boundary of the step in progress (needs --max-inflight >= 2)",
    ),
    Flag("--max-queued-requests", int, 1024, "requests waiting or running before RESOURCE_EXHAUSTED"),
    Flag(
        "--max-queued-tokens",
        int,
        262144,
        "prompt tokens waiting for their first step before RESOURCE_EXHAUSTED",
    ),
    Flag(
        "--prefill-window-ms",
        float,
        0.0,
        "a new prefill may wait this long for others to batch with (shrinks as the queue fills)",
    ),
    Flag("--default-max-tokens", int, 256, "max_tokens of a request that sets none"),
    Flag(
        "--stream-interval",
        int,
        1,
        "tokens a streamed chunk carries after the first (1: every token at once; more: fewer, larger chunks)",
    ),
    Flag("--worker-timeout", float, 5.0, "seconds without a worker heartbeat before it counts as lost"),
    Flag("--step-timeout", float, 300.0, "seconds a step may go unanswered before the worker counts as hung"),
    Flag(
        "--restart-workers",
        bool,
        True,
        "when a worker is lost, wait for a replacement (serve starts one) and resume its requests",
    ),
    Flag("--max-worker-restarts", int, 5, "worker losses survived before requests fail UNAVAILABLE"),
    Flag("--worker-restart-timeout", float, 300.0, "seconds to wait for a replacement worker to be ready"),
    Flag("--drain-timeout", float, 10.0, "seconds in-flight requests get to finish on SIGTERM"),
)
WORKER_FLAGS = (
    Flag("--dtype", str, "auto", "serving dtype", ("auto", "float32", "bfloat16", "float16")),
    Flag("--device", str, "auto", "compute device", ("auto", "cpu", "cuda")),
    Flag(
        "--attention-backend",
        str,
        "auto",
        "attention: triton (CUDA), cpu (C decode kernel), torch (reference); auto = triton on CUDA, cpu on CPU",
        ("auto", "cpu", "torch", "triton"),
    ),
    Flag("--kv-cache-memory", float, 0.0, "fraction of free device memory for the KV cache (0 = default)"),
    Flag(
        "--kv-cache-dtype",
        str,
        "auto",
        "what the KV cache stores: auto = the serving dtype; int8 = int8 rows with a scale each "
        "(half a bfloat16 cache's bytes per token, so decode steps read half as much and the same "
        "memory holds twice the tokens; attention sees each value within half a quantization step, "
        "1/254 of its row's largest; the cpu and triton kernels read it in place, the torch backend "
        "dequantizes what it gathers)",
        ("auto", "int8"),
    ),
    Flag("--threads", int, 0, "torch intra-op threads (0 = all cores)"),
    Flag(
        "--sbo",
        bool,
        True,
        "stage the next batch while the current one computes",
    ),
    Flag("--sbo-depth", int, 2, "steps staged ahead of the one computing (1-4)"),
    Flag("--compute-streams", int, 1, "CUDA: compute streams, DBO lanes spread over them (1-4)"),
    Flag(
        "--sbo-threads",
        bool,
        False,
        "CUDA: run SBO on threads (stage, launch, reply) instead of in one thread (a CPU worker always uses threads)",
    ),
    Flag(
        "--sbo-switch-interval-ms",
        float,
        0.2,
        "SBO: how long a thread may hold Python's interpreter lock while another waits (Python's own: 5)",
    ),
    Flag("--cuda-graphs", bool, True, "CUDA: replay captured graphs for decode-only steps"),
    Flag("--cuda-graph-max-batch", int, 256, "CUDA: largest decode batch captured as a graph"),
    Flag(
        "--small-batch-linear",
        bool,
        True,
        "bfloat16 on the CPU: decode-sized linears (1-64 rows) take duoserve's pair-layout kernel "
        "and decode-only steps of those sizes run all layers in one C call (else oneDNN, op by op)",
    ),
    Flag(
        "--block-linear",
        bool,
        True,
        "CPU linears multiply the weights as the model's files store them (a GGUF file's "
        "Q8_0/Q5_0/Q5_1/Q4_0/Q4_1/IQ4_NL blocks, Q2_K-Q6_K/IQ4_XS/IQ1_S-IQ3_S super-blocks and "
        "F16/BF16 tensors, a "
        "directory's float16/bfloat16 tensors), widened in "
        "registers: in float32 steps of 1-256 rows (1-64 on CPUs with AVX-512; else the float32 "
        "copies), and in bfloat16 on "
        "CPUs without AVX-512 BF16 or AMX every step (weights rounded to bfloat16; a weight "
        "without quantized blocks multiplies on its own bfloat16 copy)",
    ),
    Flag(
        "--dense-weights",
        str,
        "auto",
        "CPU, with --block-linear: keep dense copies of the weights that have blocks (keep: in "
        "float32 oneDNN's packed copies of them take steps of more than 256 rows (64 with AVX-512), "
        "faster there), hold the blocks alone and multiply on them at every step (drop: memory "
        "about the file's size), or (auto) drop them in bfloat16, where the blocks take every "
        "step anyway, and in float32 once the copies would take more than a quarter of the free memory",
    ),
    Flag(
        "--cpu-vector-bits",
        int,
        512,
        "CPU decode attention: the widest intrinsics path it may take, 512 (AVX-512 where the CPU "
        "has it), 256 (AVX2 + FMA) or 0 (plain C); lower it only to compare paths or avoid one",
    ),
    Flag(
        "--huge-pages",
        bool,
        True,
        "host memory in 2 MiB pages where Linux's transparent huge pages are in madvise mode: the "
        "worker starts itself again with glibc.malloc.hugetlb=1 unless GLIBC_TUNABLES sets it (fewer "
        "TLB misses where a CPU step streams the weights and the KV cache)",
    ),
    Flag(
        "--omp-spin-count",
        int,
        1000,
        "CPU: how many times an idle OpenMP thread checks for work before it sleeps (GOMP_SPINCOUNT; "
        "0 = sleep at once). The OpenMP runtime's own 300000 keeps a thread spinning through its "
        "time slice while its partner waits for a core another process took, at every barrier of a "
        "step. GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment stand",
    ),
)
WORKER_ONLY_FLAGS = (
    Flag("--zmq-curve-worker-secret", str, "", "CURVE: this worker's secret key file"),
    Flag("--zmq-curve-server-key", str, "", "CURVE: the scheduler's public key file"),
    Flag("--scheduler-address", str, "", "the scheduler's ZeroMQ address"),
    Flag("--worker-id", int, 0, "this worker's index"),
)


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag], environ: dict[str, str]) -> None:
    for flag in flags:
        default = flag.default
        raw = environ.get(flag.env)
        if raw is not None:
            try:
                default = _parse_bool(raw) if flag.type is bool else flag.type(raw)
            except ValueError:
                parser.error(f"{flag.env}={raw!r} (for {flag.name}) is not a valid {flag.type.__name__}")
        help_text = f"{flag.help} [env {flag.env}; default {default!r}]"
        if flag.type is bool:
            parser.add_argument(
                flag.name,
                dest=flag.dest,
                default=default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            parser.add_argument(
                flag.name,
                dest=flag.dest,
                type=flag.type,
                default=default,
                help=help_text,
                choices=flag.choices,
            )


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    env = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(prog="duoserve", description="gRPC LLM serving with DBO and SBO")
    sub = parser.add_subparsers(dest="command", required=True)
    groups = {
        "serve": (COMMON_FLAGS, TRACING_FLAGS, SCHEDULER_FLAGS, WORKER_FLAGS),
        "scheduler": (COMMON_FLAGS, TRACING_FLAGS, SCHEDULER_FLAGS),
        "worker": (COMMON_FLAGS, TRACING_FLAGS, WORKER_FLAGS, WORKER_ONLY_FLAGS),
    }
    helps = {
        "serve": "start the scheduler and its worker(s), wait until ready, stop all on SIGINT/SIGTERM",
        "scheduler": "run the scheduler process alone (gRPC API, queues, KV block tables)",
        "worker": "run one worker process alone (model, KV cache, kernels)",
    }
    for name, flag_groups in groups.items():
        command = sub.add_parser(name, help=helps[name], description=helps[name])
        for flags in flag_groups:
            _add_flags(command, flags, env)
    keys = sub.add_parser(
        "keys",
        help="write CURVE key pairs for a scheduler and a worker talking over tcp:// between hosts",
        description="Writes DIR/scheduler.key(_secret), DIR/worker.key(_secret) and DIR/authorized/worker.key.",
    )
    keys.add_argument("directory", metavar="DIR")
    return parser


def default_model() -> str:
    return str(find_default_model())


def default_worker_address(port: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/duoserve-{port}-{os.getpid()}.sock"


def _pick(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    address = args.worker_address or default_worker_address(args.port)
    return _pick(SchedulerConfig, args, model=args.model or default_model(), worker_address=address)


def worker_config(args: argparse.Namespace, **overrides: Any) -> Any:
    from gpu_worker.config import WorkerConfig

    model = overrides.pop("model", None) or args.model or default_model()
    return _pick(WorkerConfig, args, model=model, **overrides)


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format=f"%(asctime)s %(levelname)s {args.command}[%(process)d] %(name)s: %(message)s",
    )
    try:
        if args.command == "keys":
            from scheduler.curve import generate

            for path in generate(args.directory):
                print(path)
            sys.exit(0)
        if args.command == "serve":
            from scheduler.launcher import serve

            sys.exit(serve(args))
        if args.command == "scheduler":
            from scheduler.server import run_scheduler

            sys.exit(run_scheduler(scheduler_config(args)))
        from gpu_worker.config import WorkerConfigError

        try:
            config = worker_config(args)
        except WorkerConfigError as err:
            parser.error(str(err))
        if argv is None:  # this process's own command line: torch is not loaded yet
            from gpu_worker.thread_waits import set_spin_count

            set_spin_count(config.omp_spin_count)
            if config.huge_pages:  # it starts again, in this environment
                from gpu_worker.host_memory import restart_with_huge_pages

                restart_with_huge_pages()
        from gpu_worker.worker import run_worker

        sys.exit(run_worker(config))
    except (ConfigError, ModelNotFoundError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()

"""The worker process: loads the model, sizes the KV cache, then runs steps.

Conversation with the scheduler (protos/worker.proto): Hello at start, Configure
back, Ready once the weights are loaded and the cache is allocated and warmed up
(gpu_worker/startup.py), then Step -> StepResult until Shutdown, while a thread of
its own sends heartbeats. Knowing the KV block size from the start, the worker
builds its CPU kernels while it loads the weights.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import setproctitle
import torch
import zmq

from gpu_worker.config import CANNOT_START, WorkerConfig
from gpu_worker.host_memory import huge_pages_in_effect, keep_freed_memory
from gpu_worker.kv_cache import KVCache, allocate_kv_cache
from gpu_worker.linear import block_kernel, wants_blocks
from gpu_worker.loader import load_config
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig, ModelLoadError
from gpu_worker.pipeline import StepPipeline
from gpu_worker.runner import ModelRunner
from gpu_worker.startup import (
    capture_decode_graphs,
    load_weights,
    make_attention,
    plan_num_blocks,
    resolve_device,
    resolve_dtype,
    warm_up,
)
from gpu_worker.streams import CudaStreams
from gpu_worker.thread_waits import thread_waits_in_effect
from kernels._launch import dtype_name
from protos import worker_pb2
from scheduler import curve, tracing

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5


class Heartbeat:
    """Tells the scheduler this process is alive, from a thread and a socket of its own.

    Independent of the compute thread, so a long step never looks like a dead worker; the
    scheduler notices a hung step by its step timeout instead.
    """

    def __init__(self, config: WorkerConfig, interval: float = HEARTBEAT_INTERVAL_S) -> None:
        self.config = config
        self.message = worker_pb2.WorkerMessage(
            heartbeat=worker_pb2.Heartbeat(worker_id=config.worker_id, pid=os.getpid())
        ).SerializeToString()
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duoserve-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # A queue of 4 at most: never pile heartbeats up behind a stalled link.
        socket = dealer(zmq.Context.instance(), self.config, linger_ms=0, send_queue=4)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(zmq.Again):  # the queue is full: the scheduler is not reading
                    socket.send(self.message, zmq.NOBLOCK)
                self._stop.wait(self.interval)
        finally:
            socket.close(linger=0)


def dealer(
    context: zmq.Context[zmq.Socket[bytes]],
    config: WorkerConfig,
    linger_ms: int,
    send_queue: int | None = None,
) -> zmq.Socket[bytes]:
    """A DEALER connected to the scheduler, with the worker's CURVE keys when it has them."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, linger_ms)
    if send_queue is not None:
        socket.setsockopt(zmq.SNDHWM, send_queue)
    if config.zmq_curve_worker_secret:
        curve.secure_client(socket, config.zmq_curve_worker_secret, config.zmq_curve_server_key)
    socket.connect(config.scheduler_address)
    return socket


def results_socket(context: zmq.Context[zmq.Socket[bytes]], config: WorkerConfig) -> zmq.Socket[bytes]:
    """A DEALER to the scheduler that only sends step results (StepPipeline's `results`)."""
    return dealer(context, config, linger_ms=1000)


def run_worker(config: WorkerConfig) -> int:
    """Run one worker process until the scheduler says Shutdown; returns the exit code:
    CANNOT_START, with the reason logged, for a model or a setting it cannot start with."""
    setproctitle.setproctitle(f"duoserve: worker {config.worker_id}")
    keep_freed_memory()
    log.info("host memory: %s", huge_pages_in_effect())
    log.info("idle OpenMP threads: %s", thread_waits_in_effect())
    tracing.setup(
        tracing.WORKER_SERVICE, config.otlp_endpoint, config.otlp_protocol, config.trace_sample_ratio
    )
    try:
        return _run(config)
    except ModelLoadError as err:
        log.error("cannot load the model: %s", err)
        return CANNOT_START
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        log.error("cannot start: %s", exc.code)  # a setting this machine or model cannot run with
        return CANNOT_START
    finally:
        tracing.shutdown()


def _run(config: WorkerConfig) -> int:
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    model_config = load_config(config.model)  # a wrong path fails here, before the scheduler is told
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = dealer(context, config, linger_ms=1000)
    try:
        configure = _handshake(socket, config)
        if configure is None:
            return 1
        model, kv_cache, num_blocks = _load(config, model_config, dtype, device, configure)
        # CUDA SBO: input copies on a data stream, lanes on compute streams, tokens copied back
        # asynchronously. Without SBO everything runs on the default stream, one step at a time.
        if device.type == "cuda" and not config.sbo and config.compute_streams > 1:
            log.warning(
                "--compute-streams %d needs --sbo on CUDA; one stream is used", config.compute_streams
            )
        streams = (
            CudaStreams(device, config.compute_streams) if device.type == "cuda" and config.sbo else None
        )
        runner = ModelRunner(model, kv_cache, configure.block_size, device, seed=config.seed, streams=streams)
        warming = time.perf_counter()
        warm_up(runner, configure.block_size)
        runner.graphs = capture_decode_graphs(config, model, kv_cache, configure, streams)
        # What exists now (the model, the kernels, the runner) lives as long as the process: out of
        # the collector's sight, so that a full collection no longer walks it in the middle of a step.
        gc.collect()
        gc.freeze()
        log.info("warmed up in %.1f s", time.perf_counter() - warming)
        ready = _ready(config, model_config, dtype, configure, runner, num_blocks)
        socket.send(worker_pb2.WorkerMessage(ready=ready).SerializeToString())
        log.info(
            "ready: %d KV blocks of %d tokens (%s), %s attention, SBO %s, %s",
            ready.num_blocks,
            ready.block_size,
            ready.kv_cache_dtype,
            ready.attention_backend,
            _sbo_description(config, runner),
            _device_description(runner),
        )
        _serve_steps(socket, context, config, runner)
        log.info("shutdown requested by the scheduler")
        return 0
    finally:
        socket.close(linger=100)


def _handshake(socket: zmq.Socket[bytes], config: WorkerConfig) -> worker_pb2.Configure | None:
    """Hello to the scheduler, and its Configure back (None, logged, if it sent anything else)."""
    hello = worker_pb2.Hello(worker_id=config.worker_id, pid=os.getpid())
    socket.send(worker_pb2.WorkerMessage(hello=hello).SerializeToString())
    log.info("said Hello to the scheduler at %s; waiting for its Configure", config.scheduler_address)
    message = worker_pb2.SchedulerMessage.FromString(socket.recv())
    if message.WhichOneof("kind") != "configure":
        log.error("expected Configure from the scheduler, got %s", message.WhichOneof("kind"))
        return None
    return message.configure


def _load(
    config: WorkerConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    configure: worker_pb2.Configure,
) -> tuple[LlamaModel, KVCache, int]:
    """The model with its weights and attention, and the KV cache: (model, cache, blocks in it)."""
    kv_int8 = config.kv_cache_dtype == "int8"
    # The kernels this worker will run build beside the model's loading, each compile a
    # process of its own: a first start on a machine pays the longest of them, not their sum.
    with ThreadPoolExecutor(2, thread_name_prefix="kernel-build") as builds:
        load_blocks = config.block_linear and wants_blocks(dtype, device)
        block_build = builds.submit(block_kernel, dtype) if load_blocks else None
        attention = builds.submit(
            make_attention,
            config.attention_backend,
            model_config,
            dtype,
            device,
            configure.block_size,
            config.cpu_vector_bits,
            kv_int8,
        )
        model = load_weights(config, model_config, dtype, device, block_build)
        num_blocks = plan_num_blocks(config, model_config, device, dtype, configure)
        started = time.perf_counter()
        kv_cache = allocate_kv_cache(model_config, num_blocks, configure.block_size, dtype, device, kv_int8)
        allocated = time.perf_counter()
        model.use_attention(attention.result())
    log.info(
        "KV cache allocated in %.1f s, kernels ready %.1f s after",
        allocated - started,
        time.perf_counter() - allocated,
    )
    return model, kv_cache, num_blocks


def _one_thread(config: WorkerConfig, runner: ModelRunner) -> bool:
    """CUDA SBO runs in one thread unless --sbo-threads; on the CPU it needs its staging thread."""
    return runner.streams is not None and not config.sbo_threads


def _ready(
    config: WorkerConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    configure: worker_pb2.Configure,
    runner: ModelRunner,
    num_blocks: int,
) -> worker_pb2.Ready:
    """What the worker tells the scheduler (and through it ListModels) once it can take steps."""
    streams = runner.streams
    return worker_pb2.Ready(
        worker_id=config.worker_id,
        model_name=model_config.name,
        context_length=model_config.context_length,
        vocab_size=model_config.vocab_size,
        dtype=dtype_name(dtype),
        attention_backend=runner.model.attention_backend,
        device=str(runner.device),
        block_size=configure.block_size,
        num_blocks=num_blocks,
        kv_cache_dtype="int8" if config.kv_cache_dtype == "int8" else dtype_name(dtype),
        # A step's late inputs (ModelRunner.stage) are written in once the steps in front have
        # appended their tokens: every pipeline waits for that but CUDA SBO on threads, which
        # finishes steps on a thread of its own. On one compute stream a prompt's next chunk
        # also queues behind the chunk in front, whose K/V it reads; on several it would not.
        lookahead=streams is None or (_one_thread(config, runner) and len(streams.compute) == 1),
    )


def _sbo_description(config: WorkerConfig, runner: ModelRunner) -> str:
    if not config.sbo:
        return "off"
    if _one_thread(config, runner):
        return f"on, one thread (depth {config.sbo_depth})"
    return f"on, threads (depth {config.sbo_depth}, switch interval {config.sbo_switch_interval_ms} ms)"


def _device_description(runner: ModelRunner) -> str:
    if runner.device.type != "cuda":
        return "CPU"
    graphs = f"for decode batches up to {runner.graphs[0].sizes[-1]}" if runner.graphs else "off"
    streams = len(runner.streams.compute) if runner.streams else 1
    return f"{streams} compute stream(s), CUDA graphs {graphs}"


def _serve_steps(
    socket: zmq.Socket[bytes],
    context: zmq.Context[zmq.Socket[bytes]],
    config: WorkerConfig,
    runner: ModelRunner,
) -> None:
    """Take steps until the scheduler says Shutdown, with heartbeats beside them."""
    heartbeat = Heartbeat(config)
    heartbeat.start()
    # CPU SBO: the compute thread sends its replies on a socket of its own.
    results = results_socket(context, config) if config.sbo and runner.streams is None else None
    try:
        StepPipeline(
            socket,
            runner,
            config.sbo,
            config.sbo_depth,
            config.sbo_switch_interval_ms / 1e3,
            one_thread=_one_thread(config, runner),
            results=results,
        ).run()
    finally:
        heartbeat.stop()
        if results is not None:
            results.close(linger=1000)

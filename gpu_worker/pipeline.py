"""The SBO pipeline on the CPU: stage step k+1 on a thread while step k computes.

The staging thread owns the ZeroMQ socket: it receives Step messages, decodes
them and builds their input tensors (ModelRunner.stage), and sends results the
compute thread hands back over an inproc socket. The compute thread only runs
forward passes and sampling. With SBO off the same work runs in one thread,
one step after the other, so the two are compared A/B.

Per step the worker reports staging time and how much of it was exposed (the
compute thread stood waiting for it), and the time it waited for the scheduler
while sequences were in flight (waiting with nothing to do does not count).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from opentelemetry.trace import Span

from gpu_worker.runner import ModelRunner, StagedStep
from protos import worker_pb2
from scheduler import tracing

log = logging.getLogger(__name__)

_RESULTS_ADDRESS = "inproc://duoserve-results"


@dataclass(slots=True)
class _Staged:
    staged: StagedStep | None  # None: shut down
    arrived_at: float  # when the Step message was received
    error: str = ""
    step_id: int = 0


def _error_message(step_id: int, message: str) -> worker_pb2.WorkerMessage:
    return worker_pb2.WorkerMessage(error=worker_pb2.WorkerError(step_id=step_id, message=message))


class _Timings:
    """Splits idle time into exposed staging and waiting for the scheduler."""

    def __init__(self) -> None:
        self.ready_at = time.perf_counter()

    def fill(self, result: worker_pb2.StepResult, item: _Staged, had_work: bool, started: float) -> None:
        staged = item.staged
        assert staged is not None
        result.staging_seconds = staged.staging_seconds
        # The compute thread was free from ready_at; the step arrived at arrived_at and was
        # staged at staged_at. Idle before arrival is waiting for the scheduler; idle after it
        # is staging the compute thread could not hide.
        begin = max(self.ready_at, item.arrived_at)
        result.exposed_staging_seconds = min(staged.staging_seconds, max(0.0, staged.staged_at - begin))
        result.wait_seconds = max(0.0, item.arrived_at - self.ready_at) if had_work else 0.0
        result.compute_seconds = time.perf_counter() - started


def _step_span(staged: StagedStep) -> Span:
    """The worker's span of one step: child of the first traced sequence's span, linked to all of them."""
    parent, links = tracing.links_and_parent(staged.traceparents)
    batch = staged.batch
    decodes = batch.decode.num_seqs if batch is not None and batch.decode is not None else 0
    tokens = batch.num_tokens if batch is not None else 0
    return tracing.tracer().start_span(
        "worker.step",
        context=parent,
        links=links,
        attributes={
            "duoserve.step_id": staged.step_id,
            "duoserve.lane": staged.lane,
            "duoserve.batch.sequences": len(batch.chunk_order) if batch is not None else 0,
            "duoserve.batch.tokens": tokens,
            "duoserve.batch.decode_tokens": decodes,
            "duoserve.batch.prefill_tokens": tokens - decodes,
            "duoserve.batch.traced_sequences": len(staged.traceparents),
        },
    )


class StepPipeline:
    """Receives, stages, executes and answers steps until the scheduler says Shutdown."""

    def __init__(self, socket: zmq.Socket, runner: ModelRunner, sbo: bool) -> None:
        self.socket = socket
        self.runner = runner
        self.sbo = sbo

    def run(self) -> None:
        if self.sbo:
            self._run_overlapped()
        else:
            self._run_sequential()

    # ------------------------------------------------------------------ shared pieces

    def _receive(self, message_bytes: bytes) -> _Staged:
        arrived = time.perf_counter()
        message = worker_pb2.SchedulerMessage.FromString(message_bytes)
        kind = message.WhichOneof("kind")
        if kind == "shutdown":
            return _Staged(None, arrived)
        if kind != "step":
            return _Staged(None, arrived, error=f"unexpected {kind} message", step_id=0)
        try:
            staged = self.runner.stage(message.step)
        except Exception as err:
            log.exception("staging step %d failed", message.step.step_id)
            return _Staged(None, arrived, error=f"staging failed: {err}", step_id=message.step.step_id)
        return _Staged(staged, arrived)

    def _execute(self, item: _Staged, timings: _Timings, send: Callable[[bytes], None]) -> None:
        assert item.staged is not None
        had_work = self.runner.has_work_in_flight
        started = time.perf_counter()
        span = _step_span(item.staged) if tracing.enabled() and item.staged.traceparents else None
        try:
            result = self.runner.execute(item.staged)
        except Exception as err:
            log.exception("step %d failed", item.staged.step_id)
            if span is not None:
                span.record_exception(err)
                span.end()
            send(_error_message(item.staged.step_id, f"step failed: {err}").SerializeToString())
            timings.ready_at = time.perf_counter()
            return
        timings.fill(result, item, had_work, started)
        if span is not None:
            span.set_attributes(
                {
                    "duoserve.step.staging_seconds": result.staging_seconds,
                    "duoserve.step.exposed_staging_seconds": result.exposed_staging_seconds,
                    "duoserve.step.compute_seconds": result.compute_seconds,
                    "duoserve.step.wait_seconds": result.wait_seconds,
                }
            )
            span.end()
        send(worker_pb2.WorkerMessage(result=result).SerializeToString())
        timings.ready_at = time.perf_counter()

    # ------------------------------------------------------------------ SBO off

    def _run_sequential(self) -> None:
        timings = _Timings()
        while True:
            item = self._receive(self.socket.recv())
            if item.staged is None:
                if item.error:
                    self.socket.send(_error_message(item.step_id, item.error).SerializeToString())
                    continue
                return
            self._execute(item, timings, self.socket.send)

    # ------------------------------------------------------------------ SBO on

    def _run_overlapped(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        results_in = context.socket(zmq.PULL)
        results_in.bind(_RESULTS_ADDRESS)
        results_out = context.socket(zmq.PUSH)
        results_out.connect(_RESULTS_ADDRESS)
        staged_queue: queue.Queue[_Staged] = queue.Queue()
        stager = threading.Thread(
            target=self._staging_loop, args=(results_in, staged_queue), name="duoserve-staging", daemon=True
        )
        stager.start()
        timings = _Timings()
        try:
            while True:
                item = staged_queue.get()
                if item.staged is None:
                    if item.error:
                        results_out.send(_error_message(item.step_id, item.error).SerializeToString())
                        continue
                    return
                self._execute(item, timings, results_out.send)
        finally:
            results_out.send(b"")  # wakes the staging thread so it exits
            stager.join(timeout=5)
            results_out.close(linger=0)

    def _staging_loop(self, results_in: zmq.Socket, staged_queue: queue.Queue[_Staged]) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(results_in, zmq.POLLIN)
        shutting_down = False
        try:
            while True:
                events = dict(poller.poll())
                if results_in in events:
                    payload = results_in.recv()
                    if not payload:
                        return
                    self.socket.send(payload)
                if self.socket in events and not shutting_down:
                    item = self._receive(self.socket.recv())
                    shutting_down = item.staged is None and not item.error
                    staged_queue.put(item)
        finally:
            results_in.close(linger=0)

"""The SBO pipeline: stage step k+1 while step k computes.

On the CPU a forward pass occupies the thread that runs it, so staging needs a
thread of its own. The staging thread owns the ZeroMQ socket: it receives Step
messages, decodes them and builds their input tensors (ModelRunner.stage), at
most `sbo_depth` steps ahead, and sends the results handed back over an inproc
socket. The compute thread only runs forward passes and sampling.

On a GPU a launch returns at once, so by default one thread does it all: it
stages step k+1 (pinned inputs copied on the data stream) while the device
computes step k, launches it behind step k, and answers each step when its
tokens land (_run_one_thread). `--sbo-threads` runs the CPU's threads instead,
plus a third that waits for each step's tokens and makes its reply. With SBO off
the same work runs in one thread, one step after the other, so they compare A/B.

Per step the worker reports staging time and how much of it was exposed (the
compute thread stood waiting for it), and the time it waited for the scheduler
while sequences were in flight (waiting with nothing to do does not count).

Urgent steps (Step.urgent: interactive prefills the scheduler sends while a step
computes) do not wait for that step to finish: the compute thread runs them at
its next block boundary (LlamaModel.forward's yield point), answers them, and
resumes. They touch only their own sequences, so the step they interrupt computes
exactly what it would have. A step never waits longer for an urgent one than one
attention or MLP block. With SBO off there is no thread to receive them early, and
urgent steps run in arrival order like any other.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq
from opentelemetry.trace import Span

from gpu_worker.runner import ModelRunner, StagedStep
from protos import worker_pb2
from scheduler import tracing

log = logging.getLogger(__name__)

# Hands on a step's reply maker and the CUDA event after which its tokens are on the host.
Deliver = Callable[[Callable[[], bytes], "torch.cuda.Event | None"], None]

# Each pipeline's results socket has an address of its own: a pipeline whose staging thread is
# still closing its socket must not keep the next pipeline in the process from binding.
_pipeline_numbers = itertools.count()
_DEPTH_RECHECK_MS = 1  # with --sbo-depth steps staged, look again this often for room


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
        self.nested_seconds = 0.0  # compute time of urgent steps run inside other steps, in total

    def fill(
        self,
        result: worker_pb2.StepResult,
        item: _Staged,
        had_work: bool,
        started: float,
        inner: float,
        nested: bool,
    ) -> None:
        """`inner`: seconds urgent steps took inside this one (not this step's compute). `nested`:
        this one ran inside another step, staged while that computed: no wait, nothing exposed."""
        staged = item.staged
        assert staged is not None
        result.staging_seconds = staged.staging_seconds
        result.forecast = staged.forecast
        result.compute_seconds = time.perf_counter() - started - inner
        if nested:
            return
        # The compute thread was free from ready_at; the step arrived at arrived_at and was
        # staged at staged_at. Idle before arrival is waiting for the scheduler; idle after it
        # is staging the compute thread could not hide.
        begin = max(self.ready_at, item.arrived_at)
        result.exposed_staging_seconds = min(staged.staging_seconds, max(0.0, staged.staged_at - begin))
        result.wait_seconds = max(0.0, item.arrived_at - self.ready_at) if had_work else 0.0


@dataclass(slots=True)
class _Launched:
    """A launched step waiting for its tokens (one-thread SBO)."""

    reply: Callable[[], bytes]
    done: torch.cuda.Event | None  # None: the reply can be made now

    def finished(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class _StepQueue:
    """Staged steps from the staging thread to the compute thread; urgent ones jump the queue."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._steps: collections.deque[_Staged] = collections.deque()
        self._urgent: collections.deque[_Staged] = collections.deque()
        # Set when an urgent step is queued, cleared by the compute thread before it takes them:
        # C code that runs many layers in one call reads it at each boundary (kernels/cpu_stack.py).
        self.urgent_pending = ctypes.c_int32(0)

    def put(self, item: _Staged) -> None:
        with self._ready:
            urgent = item.staged is not None and item.staged.urgent
            (self._urgent if urgent else self._steps).append(item)
            if urgent:
                self.urgent_pending.value = 1
            self._ready.notify()

    def get(self) -> _Staged:
        """The next step to run, urgent ones first; blocks until there is one."""
        with self._ready:
            while not (self._urgent or self._steps):
                self._ready.wait()
            return (self._urgent or self._steps).popleft()

    def __len__(self) -> int:
        with self._ready:
            return len(self._steps)

    def take_urgent(self) -> _Staged | None:
        """An urgent step waiting to run, without blocking."""
        with self._ready:
            return self._urgent.popleft() if self._urgent else None


class _UrgentSteps:
    """The compute thread's yield point between blocks: runs the urgent steps that have arrived.
    `pending` is set while there are some, so a step that runs every layer in one C call stops
    only at a boundary where there is work (kernels/cpu_stack.py, BoundStack.run)."""

    def __init__(self, queue: _StepQueue, run: Callable[[_Staged], None]) -> None:
        self.queue = queue
        self.run = run
        self.pending = queue.urgent_pending

    def __call__(self) -> None:
        self.pending.value = 0  # before taking: one queued after this sets it again
        while (urgent := self.queue.take_urgent()) is not None:
            self.run(urgent)


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
            "duoserve.step.urgent": staged.urgent,
            "duoserve.step.forecast": staged.forecast,
            "duoserve.batch.sequences": len(batch.chunk_order) if batch is not None else 0,
            "duoserve.batch.tokens": tokens,
            "duoserve.batch.decode_tokens": decodes,
            "duoserve.batch.prefill_tokens": tokens - decodes,
            "duoserve.batch.traced_sequences": len(staged.traceparents),
        },
    )


class StepPipeline:
    """Receives, stages, executes and answers steps until the scheduler says Shutdown."""

    def __init__(
        self,
        socket: zmq.Socket,
        runner: ModelRunner,
        sbo: bool,
        sbo_depth: int = 2,
        switch_interval: float | None = None,
        one_thread: bool = False,
        results: zmq.Socket | None = None,
    ) -> None:
        """`sbo_depth`: steps the staging thread may hold staged ahead of the compute thread.
        `switch_interval`: with SBO, Python's thread switch interval in seconds while the pipeline
        runs (None: leave it). A thread that wants the interpreter lock waits up to that long for
        one that holds it: with Python's 5 ms, every hand-over between the staging, compute and
        reply threads could cost a whole GPU decode step. `one_thread`: SBO in one thread (CUDA:
        the device computes while the thread stages; see _run_one_thread). `results`: a socket to
        the scheduler that only sends, for the compute thread's replies in CPU SBO: they then go
        out as soon as they are made, not through the staging thread, which would have to wake up
        for each one while the next forward runs (None: through the staging thread, on `socket`)."""
        assert sbo_depth >= 1, f"sbo_depth {sbo_depth} < 1"
        self.socket = socket
        self.runner = runner
        self.sbo = sbo
        self.sbo_depth = sbo_depth
        self.switch_interval = switch_interval
        self.one_thread = one_thread
        self.results = results

    def run(self) -> None:
        if not self.sbo:
            self._run_sequential()
            return
        if self.one_thread:
            self._run_one_thread()
            return
        previous = sys.getswitchinterval()
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
        try:
            self._run_overlapped()
        finally:
            sys.setswitchinterval(previous)

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

    def _execute(
        self,
        item: _Staged,
        timings: _Timings,
        deliver: Deliver,
        yield_point: Callable[[], None] | None = None,
        nested: bool = False,
    ) -> None:
        """Run one step and hand `deliver` the function that makes its reply, with the CUDA event
        after which its tokens are on the host (None: they are already). That function waits for
        the event (on a GPU with SBO the tokens are still being copied back when execute returns)
        and runs on whichever thread sends. `nested`: run inside another step (an urgent
        one): the compute thread was busy, so it neither waited for it nor becomes free after it."""
        assert item.staged is not None
        staged = item.staged
        had_work = self.runner.has_work_in_flight
        started = time.perf_counter()
        nested_before = timings.nested_seconds
        span = _step_span(staged) if tracing.enabled() and staged.traceparents else None

        def failed(err: Exception) -> bytes:
            log.error("step %d failed: %s", staged.step_id, err, exc_info=err)
            if span is not None:
                span.record_exception(err)
                span.end()
            return _error_message(staged.step_id, f"step failed: {err}").SerializeToString()

        try:
            pending = self.runner.execute(staged, yield_point)
        except Exception as err:
            message = failed(err)
            deliver(lambda: message, None)
            if not nested:
                timings.ready_at = time.perf_counter()
            return
        timings.fill(pending.result, item, had_work, started, timings.nested_seconds - nested_before, nested)

        def reply() -> bytes:
            try:
                result = self.runner.finish(pending)
            except Exception as err:
                return failed(err)
            if span is not None:
                span.set_attributes(
                    {
                        "duoserve.step.staging_seconds": result.staging_seconds,
                        "duoserve.step.exposed_staging_seconds": result.exposed_staging_seconds,
                        "duoserve.step.compute_seconds": result.compute_seconds,
                        "duoserve.step.sampling_seconds": result.sampling_seconds,
                        "duoserve.step.wait_seconds": result.wait_seconds,
                    }
                )
                span.end()
            return worker_pb2.WorkerMessage(result=result).SerializeToString()

        deliver(reply, pending.done)
        if not nested:
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
            self._execute(item, timings, lambda reply, _done: self.socket.send(reply()))

    # ------------------------------------------------------------------ SBO on, one thread

    def _run_one_thread(self) -> None:
        """CUDA SBO without threads: launches return at once, so while the device computes step k
        this thread stages step k+1 (its inputs copied on the data stream) and launches it behind
        step k. A lookahead step (sent while the step in front computes) whose inputs are tokens a
        launched step samples waits for them: the steps in front are answered, the late inputs
        written into the uploaded ones on the compute stream, and the step launched. Right after
        launching a step that leaves a prompt unfinished it builds the next window on the host
        (ModelRunner.forecast), so that the window is only uploaded when the scheduler sends it.
        It answers each step as soon as its tokens are back, in order, and between messages it
        looks for them without blocking. At most `sbo_depth` steps are launched and unanswered;
        with that many it waits for the oldest.

        Exposed staging here is staging while the device had nothing to run: all of it when
        nothing was launched, none when a launched step was still running once staging ended, and
        (not knowing when the device went idle) all of it when the last one finished meanwhile.
        """
        timings = _Timings()
        launched: collections.deque[_Launched] = collections.deque()

        def answer_finished() -> None:
            while launched and launched[0].finished():
                self.socket.send(launched.popleft().reply())
                if not launched:
                    timings.ready_at = time.perf_counter()  # the device has nothing left to run

        def deliver(reply: Callable[[], bytes], done: torch.cuda.Event | None) -> None:
            launched.append(_Launched(reply, done))

        while True:
            answer_finished()
            if len(launched) >= self.sbo_depth:
                launched[0].wait()
                continue
            if launched and not self.socket.poll(0):
                continue  # a step is running: look again for its tokens, and for the next step
            busy = bool(launched)
            item = self._receive(self.socket.recv())
            if item.staged is None:
                if item.error:
                    message = _error_message(item.step_id, item.error).SerializeToString()
                    deliver(lambda message=message: message, None)  # type: ignore[misc]
                    continue
                for step in launched:  # shut down: answer what was launched first
                    step.wait()
                answer_finished()
                return
            if launched and not launched[-1].finished():
                timings.ready_at = math.inf  # the device computed all through staging
            elif busy:
                timings.ready_at = item.arrived_at
            late = item.staged.late  # a lookahead step: some inputs are tokens the steps in front sample
            while late is not None and not late.ready() and launched:
                launched[0].wait()
                answer_finished()
            self._execute(item, timings, deliver)
            if not item.staged.urgent:
                self.runner.forecast(item.staged)  # while the device computes it

    # ------------------------------------------------------------------ SBO on, threads

    def _run_overlapped(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        results_in = context.socket(zmq.PULL)
        address = f"inproc://duoserve-results-{next(_pipeline_numbers)}"
        results_in.bind(address)
        staged_queue = _StepQueue()
        stager = threading.Thread(
            target=self._staging_loop, args=(results_in, staged_queue), name="duoserve-staging", daemon=True
        )
        stager.start()
        timings = _Timings()
        # On a GPU with SBO a reply waits for its step's tokens, so a thread of its own makes and
        # sends the replies, in order: the compute thread goes on launching and the staging thread
        # goes on staging. On the CPU the step is done when execute returns, and the compute
        # thread sends its reply itself: on `results` when the worker gave one, else through the
        # staging thread.
        deliver: Deliver
        close: Callable[[], None]  # after the last reply: b"" wakes the staging thread so it exits
        if self.runner.streams is not None:
            replies: queue.SimpleQueue[Callable[[], bytes] | None] = queue.SimpleQueue()
            finisher = threading.Thread(
                target=self._finishing_loop,
                args=(context, address, replies),
                name="duoserve-replies",
                daemon=True,
            )
            finisher.start()
            deliver = lambda reply, _done: replies.put(reply)  # noqa: E731

            def stop_finisher() -> None:  # it sends b"" after the replies queued before None
                replies.put(None)
                finisher.join(timeout=30)

            close = stop_finisher
        else:
            results_out = context.socket(zmq.PUSH)
            results_out.connect(address)
            replies_to = results_out if self.results is None else self.results

            def send_now(reply: Callable[[], bytes], _done: torch.cuda.Event | None) -> None:
                replies_to.send(reply())

            def close_results() -> None:
                results_out.send(b"")
                results_out.close(linger=0)

            deliver, close = send_now, close_results

        def run_urgent(urgent: _Staged) -> None:
            """Between two blocks of the step in progress: run one urgent step that arrived."""
            started = time.perf_counter()
            self._execute(urgent, timings, deliver, nested=True)
            timings.nested_seconds += time.perf_counter() - started

        run_urgent_steps = _UrgentSteps(staged_queue, run_urgent)

        try:
            while True:
                item = staged_queue.get()
                if item.staged is None:
                    if item.error:
                        message = _error_message(item.step_id, item.error).SerializeToString()
                        deliver(lambda message=message: message, None)  # type: ignore[misc]
                        continue
                    return
                self._execute(item, timings, deliver, run_urgent_steps)
        finally:
            close()
            stager.join(timeout=5)
            if stager.is_alive():
                log.warning("the staging thread did not stop within 5 s of the last reply; leaving it")

    def _finishing_loop(
        self, context: zmq.Context, address: str, replies: queue.SimpleQueue[Callable[[], bytes] | None]
    ) -> None:
        """Makes each reply (waiting for its step's tokens) and passes it to the staging thread."""
        results_out = context.socket(zmq.PUSH)
        results_out.connect(address)
        try:
            while (reply := replies.get()) is not None:
                results_out.send(reply())
        finally:
            results_out.send(b"")
            results_out.close(linger=0)

    def _staging_loop(self, results_in: zmq.Socket, staged_queue: _StepQueue) -> None:
        """Receives and stages steps, at most `sbo_depth` ahead of the compute thread, and sends replies."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(results_in, zmq.POLLIN)
        receiving = True
        shutting_down = False
        try:
            while True:
                # Ordinary steps only count towards the depth; while it is full nothing is received.
                room = len(staged_queue) < self.sbo_depth
                if room != receiving and not shutting_down:
                    poller.modify(self.socket, zmq.POLLIN if room else 0)
                    receiving = room
                events = dict(poller.poll(None if room else _DEPTH_RECHECK_MS))
                if results_in in events:
                    payload = results_in.recv()
                    if not payload:
                        return
                    self.socket.send(payload)
                if self.socket in events and not shutting_down:
                    item = self._receive(self.socket.recv())
                    shutting_down = item.staged is None and not item.error
                    staged_queue.put(item)
                    if item.staged is not None and not item.staged.urgent:
                        self.runner.forecast(item.staged)  # while the step computes
        finally:
            results_in.close(linger=0)

"""The scheduler's core: admits requests, plans steps, keeps batches in flight (DBO).

Everything runs on the asyncio event loop and nothing here blocks on the worker:
a step is dispatched as soon as a lane is free, and a result is turned into
client events, freed blocks and the lane's next step as soon as it arrives.
With lookahead (BatchPlanner) the second lane carries the next step of the
sequences in the first, so even one lane's worth of sequences keeps two steps
in flight. Urgent steps travel on a lane of their own beside the DBO lanes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from protos import worker_pb2
from protos.running import RunningEntry, pack_running
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.output_processor import InflightBatch, OutputProcessor
from scheduler.planner import BatchPlanner, PlannerLimits, StepPlan
from scheduler.request import FinishReason, OutputEvent, Request, RequestState
from scheduler.worker_link import WorkerLink

log = logging.getLogger(__name__)


class Admission(enum.Enum):
    ADMITTED = "admitted"
    NOT_READY = "not_ready"
    SHUTTING_DOWN = "shutting_down"
    QUEUE_FULL_REQUESTS = "queue_full_requests"
    QUEUE_FULL_TOKENS = "queue_full_tokens"


IDLE_RATIO_WINDOW_S = 10.0


@dataclass(slots=True)
class WorkerTimes:
    """Seconds the worker reported across all steps (see StepResult), and over a recent window."""

    busy: float = 0.0  # forward + sampling
    sampling: float = 0.0  # of busy, the sampler's
    wait: float = 0.0  # idle while sequences were in flight
    staging: float = 0.0
    exposed_staging: float = 0.0
    exposed_staging_full: float = 0.0  # of it, in steps staged in full (not from a forecast)
    steps: int = 0
    forecast_steps: int = 0  # staged from the worker's forecast of them
    # Of busy and steps, those of decode steps: every sequence in them computed one token.
    decode_busy: float = 0.0
    decode_steps: int = 0
    recent: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, result: worker_pb2.StepResult, decode: bool = False) -> None:
        """Count one step's result; `decode`: every sequence in the step computed one token."""
        self.busy += result.compute_seconds
        self.sampling += result.sampling_seconds
        if decode:
            self.decode_busy += result.compute_seconds
            self.decode_steps += 1
        self.wait += result.wait_seconds
        self.staging += result.staging_seconds
        self.exposed_staging += result.exposed_staging_seconds
        if not result.forecast:
            self.exposed_staging_full += result.exposed_staging_seconds
        self.steps += 1
        self.forecast_steps += result.forecast
        self.recent.append((time.monotonic(), result.compute_seconds, result.wait_seconds))

    def idle_ratio(self, window: float = IDLE_RATIO_WINDOW_S) -> float:
        """wait / (wait + busy) over the steps that ended in the last `window` seconds (0 when none)."""
        since = time.monotonic() - window
        busy = wait = 0.0
        for ended, step_busy, step_wait in list(self.recent):
            if ended >= since:
                busy += step_busy
                wait += step_wait
        return wait / (wait + busy) if wait + busy > 0 else 0.0


class Engine:
    """Owns the queues, the block pool and the in-flight batches of one worker."""

    def __init__(
        self, config: SchedulerConfig, eos_token_ids: frozenset[int], debug_checks: bool = False
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.debug_checks = debug_checks
        self.worker_info: worker_pb2.Ready | None = None
        self.blocks: BlockManager | None = None
        self.planner: BatchPlanner | None = None
        self.outputs: OutputProcessor | None = None
        self._link = WorkerLink(config.worker_address, config.zmq_curve_secret, config.zmq_curve_authorized)
        self._requests: dict[int, Request] = {}
        self._inflight: dict[int, InflightBatch] = {}
        self._free_lanes = list(range(config.lanes))
        # Urgent steps' own lane (one in flight at a time), beside the DBO lanes; None: no urgent steps.
        self._urgent_lane = config.lanes if config.urgent_steps and config.lanes >= 2 else None
        self._pending_releases: list[int] = []
        self._step_ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._recv_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._last_heard = 0.0  # monotonic time of the worker's last message
        self._window_timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self.worker_lost = False
        self.on_worker_lost: Callable[[], object] | None = None
        self.on_worker_ready: Callable[[], object] | None = None
        self.worker_restarts = 0
        self._lost_reason = ""
        self._restart_deadline = 0.0
        self._restart_watchdog: asyncio.Task[None] | None = None
        self.num_preemptions = 0
        self.num_urgent_steps = 0
        self.worker_times = WorkerTimes()

    # ------------------------------------------------------------------ lifecycle

    @property
    def ready(self) -> bool:
        return self.worker_info is not None and not self.worker_lost

    def _configure(self) -> worker_pb2.Configure:
        return worker_pb2.Configure(
            block_size=self.config.block_size,
            max_blocks=self.config.num_kv_blocks,
            max_num_seqs=self.config.max_num_seqs,
        )

    async def start(self) -> worker_pb2.Ready:
        """Wait for the worker to connect, configure it, and start serving."""
        ready = await self._link.handshake(self._configure())
        self.blocks = BlockManager(ready.num_blocks, ready.block_size, prefix_cache=self.config.prefix_cache)
        limits = PlannerLimits(
            max_batched_tokens=self.config.max_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            prefill_chunk=self.config.prefill_chunk,
            max_inflight=self.config.lanes,
            min_lane_seqs=self.config.lane_min_seqs(ready.device),
            prefill_window=self.config.prefill_window_ms / 1000,
            lookahead=self._lookahead(ready),
        )
        self.planner = BatchPlanner(self.blocks, limits)
        self.outputs = OutputProcessor(self.eos_token_ids, ready.context_length, self.config.stream_interval)
        self.worker_info = ready
        self._recv_task = asyncio.create_task(self._receive_loop(), name="worker-results")
        self._last_heard = time.monotonic()
        self._watchdog_task = asyncio.create_task(self._watchdog(), name="worker-watchdog")
        log.info(
            "worker ready: %s, %s on %s, attention %s, %d KV blocks of %d tokens (%s), lookahead %s",
            ready.model_name,
            ready.dtype,
            ready.device,
            ready.attention_backend,
            ready.num_blocks,
            ready.block_size,
            ready.kv_cache_dtype or ready.dtype,
            "on" if limits.lookahead else "off",
        )
        return ready

    def _lookahead(self, ready: worker_pb2.Ready) -> bool:
        """Plan sequences' next steps while their current ones are in flight: --lookahead, a second
        lane to send them on, and a worker that takes them."""
        return self.config.lookahead and self.config.lanes >= 2 and ready.lookahead

    async def drain(self, timeout: float) -> None:
        """Stop admitting, give running requests `timeout` seconds, then abort the rest as UNAVAILABLE."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request in list(self._requests.values()):
            self._fail(request, "UNAVAILABLE", "the server is shutting down")

    async def close(self) -> None:
        if self.worker_info is not None and not self.worker_lost:
            try:
                await asyncio.wait_for(
                    self._link.send(worker_pb2.SchedulerMessage(shutdown=worker_pb2.Shutdown())), 1
                )
            except (TimeoutError, OSError) as err:
                log.warning("could not tell the worker to shut down: %s", err)
        for task in (self._recv_task, self._watchdog_task, self._restart_watchdog):
            if task is not None:
                task.cancel()
        self._link.close()

    # ------------------------------------------------------------------ requests

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def submit(self, request: Request) -> Admission:
        if self._stopping:
            return Admission.SHUTTING_DOWN
        if not self.ready or self.planner is None:
            return Admission.NOT_READY
        if len(self._requests) >= self.config.max_queued_requests:
            return Admission.QUEUE_FULL_REQUESTS
        if self.planner.queued_prompt_tokens + request.prompt_len > self.config.max_queued_tokens:
            return Admission.QUEUE_FULL_TOKENS
        self._requests[request.seq_id] = request
        self.planner.add(request)
        if request.deadline is not None:
            delay = max(0.0, request.deadline - time.monotonic())
            request.deadline_timer = asyncio.get_running_loop().call_later(delay, self._expire, request)
        self._dispatch()
        return Admission.ADMITTED

    def _expire(self, request: Request) -> None:
        """The request's deadline_ms passed: DEADLINE_EXCEEDED, and its blocks freed within one step."""
        if request.state is RequestState.FINISHED or request.seq_id not in self._requests:
            return
        never_ran = request.state is RequestState.WAITING and request.num_preemptions == 0
        where = "while queued (it never ran)" if never_ran else "while it was generating"
        self._end_with_error(
            request, "DEADLINE_EXCEEDED", f"deadline_ms={request.params.deadline_ms} passed {where}"
        )
        self._dispatch()

    def abort(self, request: Request) -> None:
        """Stop a request the client gave up on; its blocks are freed within one step."""
        if request.state is RequestState.FINISHED or request.seq_id not in self._requests:
            return
        request.aborted = True
        request.finish_reason = FinishReason.ABORTED
        if not request.in_flight:
            self._finish(request)
        # In flight: freed when that batch's result comes back.

    @property
    def num_inflight_batches(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ stepping

    def _dispatch(self) -> None:
        """Fill every free lane with a planned step, and the urgent lane with an urgent one."""
        assert self.planner is not None
        while not self.worker_lost:
            if (
                self._urgent_lane is not None
                and self._inflight
                and all(batch.lane != self._urgent_lane for batch in self._inflight.values())
                and self.planner.has_urgent()
                and (plan := self.planner.plan_urgent()) is not None
            ):
                self._send(plan, self._urgent_lane, urgent=True)
                continue
            if not self._free_lanes:
                return
            plan = self.planner.plan(worker_idle=not self._inflight)
            if plan is None:
                self._wake_at_window_end()
                return
            self._send(plan, self._free_lanes.pop(0))

    def _wake_at_window_end(self) -> None:
        """Re-plan when a held-back prefill's batching window ends."""
        assert self.planner is not None
        expiry = self.planner.window_expiry()
        if expiry is None or (self._window_timer is not None and not self._window_timer.cancelled()):
            return
        delay = max(0.0, expiry - time.monotonic()) + 0.001

        def wake() -> None:
            self._window_timer = None
            self._dispatch()

        self._window_timer = asyncio.get_running_loop().call_later(delay, wake)

    def _send(self, plan: StepPlan, lane: int, urgent: bool = False) -> None:
        assert self.blocks is not None
        self.num_preemptions += len(plan.preempted)
        for request in plan.preempted:
            log.debug("preempted request %s (recomputed later)", request.request_id)
            if request.trace is not None:
                request.trace.preempted(len(request.all_token_ids()))
            if request.on_worker:
                self._pending_releases.append(request.seq_id)
                request.on_worker = False
        step = worker_pb2.Step(step_id=next(self._step_ids), lane=lane, urgent=urgent)
        self.num_urgent_steps += urgent
        step.released_seq_ids = np.asarray(self._pending_releases, dtype="<u8").tobytes()
        self._pending_releases.clear()
        now = time.monotonic()
        running: list[RunningEntry] = []
        for scheduled in plan.seqs:
            request = scheduled.request
            start = request.num_scheduled_tokens  # past what steps in flight compute (lookahead)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.trace is not None:
                prefill = scheduled.num_new_tokens > 1 or start < request.prompt_len
                step.traceparents[request.seq_id] = request.trace.step_started(
                    step.step_id, lane, scheduled.num_new_tokens, start, prefill
                )
            if not request.on_worker:
                # Unknown to the worker: sent in full, with its whole block table.
                step.new_sequences.append(
                    worker_pb2.NewSequence(
                        seq_id=request.seq_id,
                        token_ids=np.asarray(request.all_token_ids(), dtype="<i4").tobytes(),
                        prompt_len=request.prompt_len,
                        block_ids=np.asarray(self.blocks.table(request.seq_id), dtype="<i4").tobytes(),
                        num_computed_tokens=request.num_computed_tokens,
                        num_new_tokens=scheduled.num_new_tokens,
                        sampling=request.params.sampling,
                    )
                )
                request.on_worker = True
            else:
                running.append(
                    RunningEntry(request.seq_id, start, scheduled.num_new_tokens, scheduled.new_block_ids)
                )
            request.joined(scheduled.num_new_tokens, scheduled.samples)
        if running:
            step.running.CopyFrom(pack_running(running))
        self._inflight[step.step_id] = InflightBatch(step.step_id, lane, plan.seqs, sent_at=now)
        task = asyncio.ensure_future(self._link.send(worker_pb2.SchedulerMessage(step=step)))
        task.add_done_callback(self._on_send_done)

    def _on_send_done(self, task: asyncio.Future[object]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sending a step to the worker failed: %s", task.exception())
            self._lose_worker("the worker was lost: it could not be reached")

    async def _watchdog(self) -> None:
        """Declare the worker lost when its heartbeats stop or a step goes unanswered too long."""
        period = min(0.25, self.config.worker_timeout / 4)
        while not self.worker_lost:
            await asyncio.sleep(period)
            now = time.monotonic()
            silent = now - self._last_heard
            if silent > self.config.worker_timeout:
                self._lose_worker(f"the worker was lost: no heartbeat for {silent:.1f} s")
            elif self._inflight:
                oldest = min(batch.sent_at for batch in self._inflight.values())
                if now - oldest > self.config.step_timeout:
                    self._lose_worker(f"the worker was lost: a step went unanswered for {now - oldest:.0f} s")

    async def _receive_loop(self) -> None:
        while True:
            message = await self._link.recv()
            self._last_heard = time.monotonic()
            kind = message.WhichOneof("kind")
            if kind == "heartbeat":
                continue
            if kind == "hello":
                await self._on_hello(message.hello)
                continue
            if kind == "ready":
                self._on_ready(message.ready)
                continue
            if kind == "result":
                self._on_result(message.result)
            elif kind == "error":
                log.error("worker failed step %d: %s", message.error.step_id, message.error.message)
                self._lose_worker(f"the worker was lost: it failed a step ({message.error.message})")
            else:
                log.warning("ignoring an unexpected %s message from the worker", kind)

    def _on_result(self, result: worker_pb2.StepResult) -> None:
        assert self.outputs is not None and self.blocks is not None
        batch = self._inflight.pop(result.step_id, None)
        if batch is None:
            log.warning("ignoring the result of unknown step %d", result.step_id)
            return
        if batch.lane != self._urgent_lane:
            self._free_lanes.append(batch.lane)
        self.worker_times.add(result, decode=all(scheduled.num_new_tokens == 1 for scheduled in batch.seqs))
        finished, tokens = self.outputs.apply(batch, result)
        for scheduled in batch.seqs:
            if scheduled.request.trace is not None:
                scheduled.request.trace.step_finished(batch.step_id)
        for scheduled in batch.seqs:  # name the blocks this step filled, before any are freed
            request = scheduled.request
            if not request.aborted and self.blocks.has_uncommitted(
                request.seq_id, request.num_computed_tokens
            ):
                self.blocks.commit(request.seq_id, request.all_token_ids(), request.num_computed_tokens)
        for request in finished:
            if request.in_flight:
                # In the lookahead step sent after this one: it ends when that comes back, and the
                # token it computes there is dropped.
                request.aborted = True
            else:
                self._finish(request)
        # The next step goes out before the text work, so the worker does not wait for it.
        self._dispatch()
        for request in self.outputs.emit(tokens):
            # A stop string ended it after it may have joined the step just dispatched: its blocks
            # are freed when that step comes back, and the token it computes there is dropped.
            request.aborted = True
            if not request.in_flight:
                self._finish(request)
        if self.debug_checks:
            self._check_integrity()

    def _finish(self, request: Request) -> None:
        assert self.planner is not None
        if request.deadline_timer is not None:
            request.deadline_timer.cancel()
        if request.trace is not None and request.seq_id in self._requests:
            ttft = (
                None if request.first_token_time is None else request.first_token_time - request.arrival_time
            )
            reason = request.finish_reason.name.lower() if request.finish_reason is not None else "error"
            request.trace.finish(
                request.prompt_len,
                len(request.output_token_ids),
                request.num_cached_prompt_tokens,
                ttft,
                reason,
                request.num_preemptions,
            )
        self.planner.remove(request)
        if request.on_worker:
            self._pending_releases.append(request.seq_id)
            request.on_worker = False
        self._requests.pop(request.seq_id, None)

    def _end_with_error(self, request: Request, code: str, message: str) -> None:
        """Fail the call now; an in-flight request's blocks are freed when its batch comes back."""
        request.emit(OutputEvent(error=(code, message)))
        request.aborted = True
        if not request.in_flight:
            self._finish(request)

    def _fail(self, request: Request, code: str, message: str) -> None:
        request.emit(OutputEvent(error=(code, message)))
        request.aborted = True
        request.forget_inflight()
        self._finish(request)

    def _lose_worker(self, reason: str) -> None:
        if self.worker_lost:
            return
        log.error("%s", reason)
        self.worker_lost = True
        if self.on_worker_lost is not None:
            self.on_worker_lost()
        if (
            self.config.restart_workers
            and self.worker_restarts < self.config.max_worker_restarts
            and not self._stopping
        ):
            self.worker_restarts += 1
            self._lost_reason = reason
            self._restart_deadline = time.monotonic() + self.config.worker_restart_timeout
            self._requeue_everything()
            log.warning(
                "waiting up to %.0f s for a replacement worker (restart %d of %d); %d requests will resume",
                self.config.worker_restart_timeout,
                self.worker_restarts,
                self.config.max_worker_restarts,
                len(self._requests),
            )
            self._restart_watchdog = asyncio.get_running_loop().create_task(self._await_replacement())
            return
        self._give_up(reason)

    def _give_up(self, reason: str) -> None:
        """No replacement to resume on: requests that had started end UNAVAILABLE; those only
        queued stay queued for whichever worker connects next (or their own deadline)."""
        for request in list(self._requests.values()):
            if request.first_scheduled_time is not None:
                self._fail(request, "UNAVAILABLE", reason)
        self._forget_worker_steps()

    def _forget_worker_steps(self) -> None:
        """The worker is gone: nothing is in flight any more and every lane is free."""
        self._inflight.clear()
        self._pending_releases.clear()
        self._free_lanes = list(range(self.config.lanes))

    def _requeue_everything(self) -> None:
        """The worker and its KV cache are gone: every request goes back to the queue, keeping its
        tokens, to be recomputed from prompt + output on the replacement (streams just pause)."""
        assert self.planner is not None and self.blocks is not None
        for request in self.planner.running[:]:
            self.planner.running.remove(request)
            request.num_preemptions += 1
            request.state = RequestState.WAITING
            self.planner.waiting.append(request)
            if request.trace is not None:
                request.trace.preempted(len(request.all_token_ids()))
        for request in self._requests.values():
            self.blocks.free(request.seq_id)
            request.num_computed_tokens = 0
            request.forget_inflight()
            request.on_worker = False
        for request in [r for r in self._requests.values() if r.aborted]:
            self._finish(request)  # cancelled while in flight: nothing left to wait for
        self._forget_worker_steps()

    async def _await_replacement(self) -> None:
        """Give up (requests end UNAVAILABLE) when no replacement is ready in time."""
        await asyncio.sleep(max(0.0, self._restart_deadline - time.monotonic()))
        if self.worker_lost:
            self._give_up(
                f"{self._lost_reason}; no replacement was ready within {self.config.worker_restart_timeout:.0f} s"
            )

    async def _on_hello(self, hello: worker_pb2.Hello) -> None:
        if not self.worker_lost:
            # One worker per scheduler: a new one saying Hello means the old one is gone, even if
            # its silence has not yet reached --worker-timeout.
            self._lose_worker(
                f"the worker was lost: worker {hello.worker_id} (pid {hello.pid}) connected in its place"
            )
        log.info("replacement worker %d (pid %d) connected", hello.worker_id, hello.pid)
        await self._link.send(worker_pb2.SchedulerMessage(configure=self._configure()))

    def _on_ready(self, ready: worker_pb2.Ready) -> None:
        assert self.planner is not None
        if not self.worker_lost:
            return
        if self._restart_watchdog is not None:
            self._restart_watchdog.cancel()
        self.worker_info = ready
        self.blocks = BlockManager(ready.num_blocks, ready.block_size, prefix_cache=self.config.prefix_cache)
        self.planner.blocks = self.blocks
        self.planner.limits = dataclasses.replace(self.planner.limits, lookahead=self._lookahead(ready))
        self.worker_lost = False
        self._last_heard = time.monotonic()
        self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog(), name="worker-watchdog")
        log.info(
            "replacement worker ready: %d KV blocks; resuming %d requests",
            ready.num_blocks,
            len(self._requests),
        )
        if self.on_worker_ready is not None:
            self.on_worker_ready()
        self._dispatch()

    def _check_integrity(self) -> None:
        assert self.blocks is not None
        self.blocks.check_integrity()
        if not self._requests and not self._inflight:
            assert self.blocks.num_free_blocks == self.blocks.num_blocks, (
                f"idle scheduler holds {self.blocks.num_used_blocks} KV blocks"
            )

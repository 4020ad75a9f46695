"""The Engine against a scripted worker over real ZeroMQ: no model, exact control of steps and timing."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest
import zmq

from protos import worker_pb2
from protos.running import unpack_running
from scheduler.config import SchedulerConfig
from scheduler.engine import Admission, Engine, WorkerTimes
from scheduler.request import FinishReason, OutputEvent, Request, RequestParams

TOKEN = 42  # what the scripted worker samples (but for eos_at_token)
EOS = 2  # the engines' EOS token id here


class SilentDetokenizer:
    """The OutputProcessor's view of a detokenizer, for token-only tests: no text, no stop strings."""

    stopped = False

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@dataclass
class ScriptedWorker:
    """Answers every Step after `step_seconds`, sampling TOKEN for each sequence that reaches its end.

    It takes steps one at a time, so a lookahead step (which it says it takes with `lookahead`) comes
    in only after the step in front of it has sampled, as in the worker's own pipelines."""

    address: str
    device: str = "cpu"
    lookahead: bool = False
    eos_at_token: int = 0  # > 0: the sequences' token this many (1-based) is EOS instead
    num_blocks: int = 64
    step_seconds: float = 0.01
    fail_at_step: int | None = None  # answer this step (1-based) with an error message
    die_at_step: int | None = None  # vanish at this step (1-based) without a word, like a killed process
    garbage_at_step: int | None = None  # send undecodable bytes before answering this step
    seen_seq_ids: set[int] = field(default_factory=set)
    steps: list[list[int]] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # time.monotonic() as each step came in
    urgent_steps: list[int] = field(default_factory=list)  # indexes into steps
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join(timeout=10)

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.connect(self.address)
        socket.send(worker_pb2.WorkerMessage(hello=worker_pb2.Hello(worker_id=0, pid=1)).SerializeToString())
        configure = worker_pb2.SchedulerMessage.FromString(socket.recv()).configure
        ready = worker_pb2.Ready(
            model_name="scripted",
            context_length=4096,
            vocab_size=100,
            dtype="float32",
            attention_backend="none",
            device=self.device,
            block_size=configure.block_size,
            num_blocks=self.num_blocks,
            lookahead=self.lookahead,
        )
        socket.send(worker_pb2.WorkerMessage(ready=ready).SerializeToString())
        lengths: dict[int, list[int]] = {}  # seq_id -> [tokens known, tokens computed]
        samples: dict[int, int] = {}  # seq_id -> tokens sampled for it
        while True:
            message = worker_pb2.SchedulerMessage.FromString(socket.recv())
            self.arrived.append(time.monotonic())
            if message.WhichOneof("kind") != "step":
                break
            step = message.step
            scheduled = []
            for new in step.new_sequences:
                lengths[new.seq_id] = [len(np.frombuffer(new.token_ids, "<i4")), new.num_computed_tokens]
                scheduled.append((new.seq_id, new.num_new_tokens))
            running = unpack_running(step.running)
            scheduled += list(zip(running.seq_ids.tolist(), running.num_new_tokens.tolist(), strict=True))
            if step.urgent:
                self.urgent_steps.append(len(self.steps))
            self.steps.append([seq_id for seq_id, _ in scheduled])
            self.seen_seq_ids.update(seq_id for seq_id, _ in scheduled)
            if len(self.steps) == self.die_at_step:
                break
            if len(self.steps) == self.garbage_at_step:
                socket.send(b"\xff\x00not a protobuf\xff")
            if len(self.steps) == self.fail_at_step:
                error = worker_pb2.WorkerError(step_id=step.step_id, message="scripted failure")
                socket.send(worker_pb2.WorkerMessage(error=error).SerializeToString())
                break
            time.sleep(self.step_seconds)
            sampled = []
            for seq_id, num_new in scheduled:
                state = lengths[seq_id]
                state[1] += num_new
                if state[1] == state[0]:
                    state[0] += 1
                    sampled.append(seq_id)
                    samples[seq_id] = samples.get(seq_id, 0) + 1
            tokens = [EOS if samples[seq_id] == self.eos_at_token else TOKEN for seq_id in sampled]
            result = worker_pb2.StepResult(
                step_id=step.step_id,
                lane=step.lane,
                seq_ids=np.asarray(sampled, dtype="<u8").tobytes(),
                token_ids=np.asarray(tokens, dtype="<i4").tobytes(),
                compute_seconds=self.step_seconds,
            )
            socket.send(worker_pb2.WorkerMessage(result=result).SerializeToString())
        socket.close(linger=0)
        context.term()


def make_request(engine: Engine, prompt_len: int, **params: Any) -> Request:
    params.setdefault("max_tokens", 4)
    params.setdefault("ignore_eos", True)
    return Request(
        request_id=f"r{prompt_len}",
        seq_id=engine.new_seq_id(),
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=RequestParams(**params),
        detokenizer=cast(Any, SilentDetokenizer()),
        events=asyncio.Queue(),
    )


async def events_of(request: Request) -> AsyncIterator[OutputEvent]:
    while True:
        event = await asyncio.wait_for(request.events.get(), timeout=10)
        yield event
        if event.finish_reason is not None or event.error is not None:
            return


async def outcome(request: Request) -> tuple[list[int], str]:
    tokens = []
    async for event in events_of(request):
        tokens += event.token_ids
        if event.error is not None:
            return tokens, event.error[0]
        if event.finish_reason is not None:
            return tokens, event.finish_reason.name
    raise AssertionError("no final event")


async def with_engine(worker: ScriptedWorker, **config: Any) -> Engine:
    engine = Engine(
        SchedulerConfig(model="scripted", worker_address=worker.address, **config), frozenset({EOS}), True
    )
    worker.start()
    await engine.start()
    return engine


async def stop(engine: Engine, worker: ScriptedWorker) -> None:
    await engine.close()
    worker.join()


def address() -> str:
    return f"ipc://{tempfile.mktemp(prefix='duoserve-engine-test-')}"


def test_a_queued_request_past_its_deadline_never_reaches_the_worker() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address(), step_seconds=0.02)
        engine = await with_engine(worker, max_num_seqs=1)
        running = make_request(engine, 5, max_tokens=30)
        queued = make_request(engine, 5, deadline_ms=100)
        assert engine.submit(running) is Admission.ADMITTED
        assert engine.submit(queued) is Admission.ADMITTED
        started = time.monotonic()
        assert await outcome(queued) == ([], "DEADLINE_EXCEEDED")
        assert 0.09 <= time.monotonic() - started < 1.0
        assert await outcome(running) == ([TOKEN] * 30, "LENGTH")
        assert queued.seq_id not in worker.seen_seq_ids
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await stop(engine, worker)

    asyncio.run(scenario())


class SlowDetokenizer(SilentDetokenizer):
    """Text work that takes `seconds` a token, and says when each token's ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.done: list[float] = []

    def push(self, token_id: int) -> str:
        time.sleep(self.seconds)
        self.done.append(time.monotonic())
        return ""


def test_the_next_step_reaches_the_worker_before_the_text_work_of_the_last() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address(), step_seconds=0.01)
        engine = await with_engine(worker)
        request = make_request(engine, 5, max_tokens=3)
        detokenizer = SlowDetokenizer(0.2)
        request.detokenizer = cast(Any, detokenizer)
        assert engine.submit(request) is Admission.ADMITTED
        assert await outcome(request) == ([TOKEN] * 3, "LENGTH")
        # Step 2 went out while the first token's text was being made, not after.
        assert len(worker.arrived) >= 3 and len(detokenizer.done) == 3
        assert worker.arrived[1] < detokenizer.done[0] - 0.1
        assert worker.arrived[2] < detokenizer.done[1] - 0.1
        await stop(engine, worker)

    asyncio.run(scenario())


def test_queue_limits_refuse_at_submit_and_name_the_limit() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address(), step_seconds=0.05)
        engine = await with_engine(worker, max_num_seqs=1, max_queued_requests=3, max_queued_tokens=12)
        first, second = make_request(engine, 5), make_request(engine, 6)
        assert engine.submit(first) is Admission.ADMITTED  # starts at once: no longer queued
        assert engine.submit(second) is Admission.ADMITTED  # queued: 6 tokens
        assert engine.submit(make_request(engine, 7)) is Admission.QUEUE_FULL_TOKENS  # 6 + 7 > 12
        assert engine.submit(make_request(engine, 6)) is Admission.ADMITTED  # 6 + 6 = 12
        assert engine.submit(make_request(engine, 1)) is Admission.QUEUE_FULL_REQUESTS  # 3 in the engine
        assert (await outcome(first))[1] == "LENGTH"
        assert (await outcome(second))[1] == "LENGTH"
        await stop(engine, worker)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("device", "dbo", "lookahead", "most_in_flight"),
    [
        ("cuda", True, False, 2),
        ("cpu", True, False, 1),
        ("cuda", False, False, 1),
        ("cpu", True, True, 2),
        ("cpu", False, True, 1),
    ],
)
def test_dbo_keeps_two_batches_in_flight_on_a_gpu_and_one_on_a_cpu_unless_it_looks_ahead(
    device: str, dbo: bool, lookahead: bool, most_in_flight: int
) -> None:
    """With --no-dbo one batch is in flight even where --max-inflight allows two. A CPU worker that
    takes lookahead steps gets the next step of the same sequences while one computes: the same
    steps as without it, two in flight."""

    async def scenario() -> None:
        worker = ScriptedWorker(address(), device=device, step_seconds=0.02, lookahead=lookahead)
        engine = await with_engine(worker, max_inflight=2, dbo=dbo)
        requests = [make_request(engine, 3, max_tokens=12) for _ in range(6)]
        for request in requests:
            engine.submit(request)
        seen = 0
        while any(r.state.name != "FINISHED" for r in requests):
            seen = max(seen, engine.num_inflight_batches)
            await asyncio.sleep(0.002)
        assert seen == most_in_flight
        for request in requests:
            assert await outcome(request) == ([TOKEN] * 12, "LENGTH")
        # A sequence is never twice in one batch, and each is in 12 steps (its prompt, which
        # samples the first token, and 11 decodes), lookahead or not: none computes a token more.
        assert all(len(ids) == len(set(ids)) for ids in worker.steps)
        assert [sum(r.seq_id in ids for ids in worker.steps) for r in requests] == [12] * 6
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await stop(engine, worker)

    asyncio.run(scenario())


def test_a_request_that_samples_eos_under_lookahead_drops_the_token_computed_after_it() -> None:
    """EOS comes as token 3 while the lookahead step for token 4 is already out: the request ends
    with its three tokens, that step's token is dropped, and its blocks are freed once it is back."""

    async def scenario() -> None:
        worker = ScriptedWorker(address(), step_seconds=0.02, lookahead=True, eos_at_token=3)
        engine = await with_engine(worker, max_inflight=2)
        stopping = make_request(engine, 5, max_tokens=10, ignore_eos=False)
        going_on = make_request(engine, 7, max_tokens=6)  # ignores EOS
        for request in (stopping, going_on):
            engine.submit(request)
        assert await outcome(stopping) == ([TOKEN, TOKEN, EOS], "STOP")
        assert await outcome(going_on) == ([TOKEN, TOKEN, EOS, TOKEN, TOKEN, TOKEN], "LENGTH")
        # The worker computed token 4 for the stopped request too (planned before EOS was known).
        assert sum(stopping.seq_id in ids for ids in worker.steps) == 4
        await asyncio.sleep(0.05)
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await stop(engine, worker)

    asyncio.run(scenario())


async def batch_load_then_interactive(
    engine: Engine, count: int, max_tokens: int, prompt_len: int
) -> tuple[list[Request], Request]:
    """`count` batch-class requests of `max_tokens`, then 0.1 s later an interactive one (3 tokens)."""
    bulk = [make_request(engine, 3, max_tokens=max_tokens, priority=2) for _ in range(count)]
    for request in bulk:
        engine.submit(request)
    await asyncio.sleep(0.1)
    interactive = make_request(engine, prompt_len, max_tokens=3, priority=0)
    engine.submit(interactive)
    return bulk, interactive


def test_an_interactive_prompt_preempts_a_batch_load_that_is_always_in_flight() -> None:
    """With lookahead both batch requests are in every step pair; the interactive one still gets a
    slot: the plan that finds its victims in flight stops looking ahead, and they come back."""

    async def scenario() -> None:
        worker = ScriptedWorker(address(), step_seconds=0.01, lookahead=True)
        engine = await with_engine(worker, max_inflight=2, max_num_seqs=2, urgent_steps=False)
        bulk, interactive = await batch_load_then_interactive(engine, 2, max_tokens=40, prompt_len=4)
        assert await outcome(interactive) == ([TOKEN] * 3, "LENGTH")
        assert not all(r.state.name == "FINISHED" for r in bulk)  # it overtook them
        for request in bulk:
            assert await outcome(request) == ([TOKEN] * 40, "LENGTH")  # the preempted one resumed
        assert engine.num_preemptions >= 1
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await stop(engine, worker)

    asyncio.run(scenario())


@pytest.mark.parametrize(("urgent_steps", "lookahead"), [(True, False), (False, False), (True, True)])
def test_an_interactive_prompt_goes_out_at_once_as_an_urgent_step(
    urgent_steps: bool, lookahead: bool
) -> None:
    """On a lane of its own: beside the bulk step in flight, and beside its lookahead too."""

    async def scenario() -> None:
        worker = ScriptedWorker(address(), device="cpu", step_seconds=0.03, lookahead=lookahead)
        engine = await with_engine(worker, max_inflight=2, urgent_steps=urgent_steps)
        bulk, interactive = await batch_load_then_interactive(engine, 4, max_tokens=20, prompt_len=6)
        in_flight_at_submit = engine.num_inflight_batches
        assert await outcome(interactive) == ([TOKEN] * 3, "LENGTH")
        for request in bulk:
            assert await outcome(request) == ([TOKEN] * 20, "LENGTH")
        bulk_steps = 2 if lookahead else 1
        if urgent_steps:
            # Sent beside the bulk steps in flight, holding the interactive prompt alone.
            assert in_flight_at_submit == bulk_steps + 1
            assert [worker.steps[i] for i in worker.urgent_steps] == [[interactive.seq_id]]
        else:
            assert in_flight_at_submit == bulk_steps and worker.urgent_steps == []
        assert all(len(ids) == len(set(ids)) for ids in worker.steps)
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await stop(engine, worker)

    asyncio.run(scenario())


def test_without_restarts_started_requests_fail_unavailable_and_queued_ones_wait_for_a_worker() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address(), fail_at_step=3)
        engine = await with_engine(worker, restart_workers=False, max_num_seqs=1)
        lost = []
        engine.on_worker_lost = lambda: lost.append(True)
        request = make_request(engine, 4, max_tokens=10)
        queued = make_request(engine, 2, max_tokens=3)
        engine.submit(request)
        engine.submit(queued)  # no batch slot: it only waits
        tokens, code = await outcome(request)
        assert code == "UNAVAILABLE" and tokens == [TOKEN, TOKEN]
        assert lost == [True] and not engine.ready
        assert engine.submit(make_request(engine, 4)) is Admission.NOT_READY
        assert queued.events.empty()  # never failed
        worker.join()
        replacement = ScriptedWorker(worker.address)  # say, restarted by a process supervisor
        replacement.start()
        assert await outcome(queued) == ([TOKEN] * 3, "LENGTH")
        await stop(engine, replacement)

    asyncio.run(scenario())


def test_a_replacement_worker_resumes_every_request_where_it_stopped() -> None:
    async def scenario() -> None:
        first = ScriptedWorker(address(), die_at_step=4, step_seconds=0.02)
        # A long --worker-timeout: the replacement's Hello is what reveals the loss.
        engine = await with_engine(first, worker_timeout=30.0, max_inflight=1)
        lost, ready = [], []
        engine.on_worker_lost = lambda: lost.append(time.monotonic())
        engine.on_worker_ready = lambda: ready.append(time.monotonic())
        running = make_request(engine, 5, max_tokens=10)
        queued = make_request(engine, 3, max_tokens=4)
        engine.submit(running)
        await asyncio.sleep(0.3)  # the first worker has vanished by now, mid-generation
        engine.submit(queued)
        assert first.steps and len(first.steps) == 4
        second = ScriptedWorker(first.address, step_seconds=0.02)
        second.start()
        assert await outcome(running) == ([TOKEN] * 10, "LENGTH")  # nothing lost or repeated
        assert await outcome(queued) == ([TOKEN] * 4, "LENGTH")
        assert len(lost) == 1 and len(ready) == 1 and engine.worker_restarts == 1 and engine.ready
        # The replacement recomputed the running request from prompt + 3 generated tokens.
        assert running.seq_id in second.seen_seq_ids
        assert engine.blocks is not None and engine.blocks.num_used_blocks == 0
        await engine.close()
        first.join()
        second.join()

    asyncio.run(scenario())


def test_bytes_that_are_no_worker_message_are_skipped() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address(), garbage_at_step=2)
        engine = await with_engine(worker)
        request = make_request(engine, 3, max_tokens=5)
        engine.submit(request)
        assert await outcome(request) == ([TOKEN] * 5, "LENGTH")
        assert engine.ready and engine.worker_restarts == 0
        await stop(engine, worker)

    asyncio.run(scenario())


def test_a_stream_interval_sends_the_first_token_alone_then_tokens_in_groups() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address())
        engine = await with_engine(worker, stream_interval=4)
        request = make_request(engine, 5, max_tokens=10)
        engine.submit(request)
        sizes = [len(event.token_ids) async for event in events_of(request)]
        # The first token at once, then four at a time, the last event whatever is left.
        assert sizes == [1, 4, 4, 1]
        assert request.output_token_ids == [TOKEN] * 10 and request.events_queued == 4
        await stop(engine, worker)

    asyncio.run(scenario())


def _bare_request(seq_id: int) -> Request:
    """A request outside any engine, for what it queues itself."""
    return Request(
        request_id=f"r{seq_id}", seq_id=seq_id, prompt_token_ids=[1], params=RequestParams(max_tokens=8),
        detokenizer=cast(Any, SilentDetokenizer()), events=asyncio.Queue(),
    )  # fmt: skip


def test_held_tokens_go_out_before_an_error_and_with_the_final_event() -> None:
    request = _bare_request(1)
    for token in (5, 6, 7):
        request.emit(OutputEvent(text=str(token), token_ids=[token]), interval=3)
    request.emit(OutputEvent(error=("UNAVAILABLE", "worker lost")), interval=3)
    queued = [request.events.get_nowait() for _ in range(request.events.qsize())]
    assert [(e.text, e.token_ids, e.error) for e in queued] == [
        ("5", [5], None),
        ("67", [6, 7], None),
        ("", [], ("UNAVAILABLE", "worker lost")),
    ]
    # A finish reason flushes what is held, whatever the interval.
    request = _bare_request(2)
    request.emit(OutputEvent(token_ids=[5]), interval=8)
    request.emit(OutputEvent(token_ids=[6]), interval=8)
    request.emit(OutputEvent(token_ids=[7], finish_reason=FinishReason.STOP), interval=8)
    queued = [request.events.get_nowait() for _ in range(request.events.qsize())]
    assert [(e.token_ids, e.finish_reason) for e in queued] == [([5], None), ([6, 7], FinishReason.STOP)]


def test_a_request_read_only_at_its_end_queues_its_events_together_when_it_ends_or_fails() -> None:
    request = _bare_request(1)
    request.streamed = False  # a unary call
    for token in (5, 6):
        request.emit(OutputEvent(text=str(token), token_ids=[token]))
    assert request.events.empty()  # its caller is not woken for each token
    request.emit(OutputEvent(text="7", token_ids=[7], finish_reason=FinishReason.LENGTH))
    queued = [request.events.get_nowait() for _ in range(request.events.qsize())]
    assert [(e.text, e.token_ids, e.finish_reason) for e in queued] == [
        ("5", [5], None),
        ("6", [6], None),
        ("7", [7], FinishReason.LENGTH),
    ]
    assert request.unsent == [] and request.events_queued == 3
    # A failure comes behind the tokens already made.
    request = _bare_request(2)
    request.streamed = False
    request.emit(OutputEvent(token_ids=[5]))
    assert request.events.empty()
    request.emit(OutputEvent(error=("DEADLINE_EXCEEDED", "deadline_ms=10 passed")))
    queued = [request.events.get_nowait() for _ in range(request.events.qsize())]
    assert [(e.token_ids, e.error) for e in queued] == [
        ([5], None),
        ([], ("DEADLINE_EXCEEDED", "deadline_ms=10 passed")),
    ]


def test_a_unary_caller_gets_every_token_of_a_request_through_the_engine() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(address())
        engine = await with_engine(worker, stream_interval=4)
        request = make_request(engine, 5, max_tokens=10)
        request.streamed = False
        engine.submit(request)
        first = await request.events.get()
        assert request.events.qsize() == 9  # queued together with the first, when the request ended
        sizes = [len(first.token_ids)] + [len(event.token_ids) async for event in events_of(request)]
        assert sizes == [1] * 10  # each token's own event: the interval is for streams
        assert request.output_token_ids == [TOKEN] * 10 and request.events_queued == 10
        await stop(engine, worker)

    asyncio.run(scenario())


def test_worker_times_count_decode_steps_apart() -> None:
    times = WorkerTimes()
    for decode, seconds in ((False, 0.3), (True, 0.04), (True, 0.05)):
        times.add(
            worker_pb2.StepResult(compute_seconds=seconds, sampling_seconds=seconds / 10), decode=decode
        )
    assert times.steps == 3 and times.decode_steps == 2
    assert times.busy == pytest.approx(0.39) and times.decode_busy == pytest.approx(0.09)
    assert times.sampling == pytest.approx(0.039)


def test_worker_times_split_exposed_staging_by_how_each_step_was_staged() -> None:
    times = WorkerTimes()
    for forecast, exposed in ((False, 0.004), (True, 0.001), (True, 0.002), (False, 0.003)):
        times.add(
            worker_pb2.StepResult(
                compute_seconds=0.01,
                staging_seconds=0.005,
                exposed_staging_seconds=exposed,
                forecast=forecast,
            )
        )
    assert times.steps == 4 and times.forecast_steps == 2
    assert times.decode_steps == 0 and times.decode_busy == 0.0  # none counted as decode steps
    assert times.exposed_staging == pytest.approx(0.010)
    assert times.exposed_staging_full == pytest.approx(0.007)  # the two steps staged in full
    assert times.staging == pytest.approx(0.020)

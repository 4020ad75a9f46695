"""ModelRunner: the worker's sequence state, and one step = stage, then execute.

`stage` turns a Step message into device inputs (it may run on the staging
thread while the previous step computes); `execute` launches the forward pass and
the sampler; `finish` waits for the sampled tokens, appends them and builds the
StepResult. On the CPU, or on a GPU without SBO, `execute` has done everything by
the time it returns. On a GPU with SBO (`streams`), execute returns once the work
is queued on the lane's compute stream and the tokens are on their way back to
pinned memory, so the next step launches without waiting; whoever sends the result
calls `finish`. Decode-only steps replay a CUDA graph when `graphs` has one.

With lookahead (scheduler/planner.py) a sequence's next step may arrive, and be
staged, before `finish` has appended the token its current step samples. Staging
then leaves that decode's input id out (LateInputs) and `execute` writes it in
just before the forward (on a GPU, on the step's compute stream, into the inputs
already uploaded). The pipeline finishes the steps in front before it executes a
step with late inputs: on the CPU every pipeline finishes a step before it
executes the next, and CUDA SBO in one thread waits for the tokens of the steps in
front only then (StepPipeline). Staging alone moves a sequence's computed and known
counts and its block table, and `finish` alone appends its tokens, so the two
never write the same field, whichever threads they run on. `--sbo-threads` on a
GPU finishes steps on a thread of its own, and with `--compute-streams` above 1 a
prompt's next chunk could run beside the chunk whose K/V it reads, so neither
takes lookahead steps (Ready.lookahead).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.batch import ForwardBatch, LateInputs, ScheduledChunk, build_forward_batch, upload_batch
from gpu_worker.cuda_graphs import DecodeGraphs
from gpu_worker.forecast import Forecasts, forecast_next_step
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import LlamaModel
from gpu_worker.sampler import Sampler, SamplerOutput, SamplingParams, SamplingRow
from gpu_worker.streams import CudaStreams, DeviceUpload
from protos import worker_pb2
from protos.running import unpack_running


class StepError(RuntimeError):
    """A Step message contradicts the worker's state (a scheduler bug or a lost message)."""


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    block_table: list[int]
    num_computed: int
    sampling: SamplingParams
    # len(token_ids), and one more for each staged step that samples it and has not finished yet.
    num_known: int


@dataclass(slots=True)
class StagedStep:
    step_id: int
    lane: int
    batch: ForwardBatch | None  # None for a step that only releases sequences
    sampled: list[SeqState]  # sequences sampling a token, in logits-row order
    scheduled: list[tuple[SeqState, int]] = field(default_factory=list)  # all, with their new tokens
    staging_seconds: float = 0.0
    staged_at: float = field(default_factory=time.perf_counter)
    traceparents: dict[int, str] = field(default_factory=dict)  # traced sequences' spans (see worker.proto)
    urgent: bool = False  # runs at the next layer boundary of the step in progress (see worker.proto)
    ready: torch.cuda.Event | None = None  # CUDA SBO: the input copies have landed
    forecast: bool = False  # taken from the forecast built while the step before computed
    late: LateInputs | None = None  # input ids `execute` writes in (CPU lookahead steps)
    # [len(sampled)] int64, filled by `finish`: the next step's input ids (gpu_worker/forecast.py).
    sampled_tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


@dataclass(slots=True)
class PendingStep:
    """An executed step whose tokens may still be on their way back (see ModelRunner.finish)."""

    result: worker_pb2.StepResult
    sampled: list[SeqState] = field(default_factory=list)
    output: SamplerOutput | None = None  # sampled on the host already
    tokens: torch.Tensor | None = None  # pinned host tensor the sampled tokens are being copied into
    sampling: torch.cuda.Event | None = None  # recorded on the step's stream before the sampler
    sampled_tokens: np.ndarray | None = None  # StagedStep.sampled_tokens, filled with the tokens
    started: torch.cuda.Event | None = None  # on the compute stream, before the step's work
    done: torch.cuda.Event | None = None  # after the step's work and the copy back


def sampling_from_proto(message: worker_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        min_p=message.min_p,
        repetition_penalty=message.repetition_penalty,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        seed=message.seed if message.has_seed else None,
        logprobs=message.logprobs if message.want_logprobs else None,
    )


def _ints(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


def _late_inputs(batch: ForwardBatch, late: list[tuple[int, SeqState, int]]) -> LateInputs | None:
    """`late` (chunk index, sequence, position of its input) as the batch rows to fill in. Late
    chunks are single-token decodes, so batch sequence n is token row n."""
    if not late:
        return None
    row_of = {chunk: n for n, chunk in enumerate(batch.chunk_order)}
    return LateInputs(
        rows=[row_of[chunk] for chunk, _, _ in late],
        token_lists=[state.token_ids for _, state, _ in late],
        positions=[position for _, _, position in late],
    )


def _seq_ids_of(step: worker_pb2.Step) -> list[int]:
    """Every sequence `step` names: running, new and released (whatever their arrays hold)."""
    ids = [new.seq_id for new in step.new_sequences]
    for data in (step.running.seq_ids, step.released_seq_ids):
        ids += np.frombuffer(data[: len(data) // 8 * 8], dtype="<u8").tolist()
    return ids


class ModelRunner:
    """Runs steps on one model and KV cache."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        seed: int = 0,
        streams: CudaStreams | None = None,
        graphs: Sequence[DecodeGraphs] = (),
    ) -> None:
        """`streams`: CUDA SBO (inputs copied on a data stream, lanes on compute streams, tokens
        copied back asynchronously). `graphs`: one set of decode graphs per compute stream (one
        when there are no `streams`); graphs share their static inputs, so no two streams may
        replay the same set."""
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed=seed)
        self.seqs: dict[int, SeqState] = {}
        self.forecasts = Forecasts()  # the staging thread's alone (gpu_worker/forecast.py)
        self.streams = streams
        self.graphs = list(graphs)
        assert not self.graphs or len(self.graphs) == (len(streams.compute) if streams else 1), (
            "one set of decode graphs per compute stream"
        )

    @property
    def has_work_in_flight(self) -> bool:
        """True while the scheduler has running sequences here (idle time then counts as waiting)."""
        return bool(self.seqs)

    def forget_all(self) -> None:
        """Drop every sequence's state and every forecast, and start the sampler's generator again
        from its seed (after warm-up, whose drawn token must not shift the first request's)."""
        self.seqs.clear()
        self.forecasts.clear()
        self.sampler.reset()

    def stage(self, step: worker_pb2.Step) -> StagedStep:
        started = time.perf_counter()
        taken = self.forecasts.take(step, self.seqs)
        batch: ForwardBatch | None
        ready = None
        if taken is not None:
            batch, sampled, scheduled, spent = taken.batch, taken.sampled, taken.scheduled, taken.seconds
            late = taken.late  # written in by execute, on a GPU into the uploaded inputs
            if self.device.type != "cpu":  # forecasts are built on the host
                batch, ready = self._upload(batch, step.lane)
        else:
            try:
                batch, sampled, scheduled, late, ready = self._stage_in_full(step)
            finally:
                if self.forecasts:  # none filed without SBO: nothing to look up
                    self.forecasts.drop_touching(_seq_ids_of(step))
            spent = 0.0
        for state in sampled:
            state.num_known += 1
        return StagedStep(
            step_id=step.step_id,
            lane=step.lane,
            batch=batch,
            sampled=sampled,
            scheduled=scheduled,
            staging_seconds=spent + time.perf_counter() - started,
            traceparents=dict(step.traceparents),
            urgent=step.urgent,
            ready=ready,
            forecast=taken is not None,
            late=late,
            sampled_tokens=np.empty(len(sampled), dtype=np.int64),
        )

    def forecast(self, staged: StagedStep) -> None:
        """Build the step likely to follow `staged` (see gpu_worker/forecast.py), for `stage`
        to take when it comes. Only worth it while the step computes: SBO calls it right after
        staging (CPU) or launching (GPU) a step. On a GPU a step staged on arrival is already
        hidden behind the other lane's step; what nothing hides there is the next window of a
        lone long prompt, so only a step leaving a prompt unfinished is forecast."""
        if self.device.type != "cpu" and len(staged.sampled) == len(staged.scheduled):
            return
        forecast = forecast_next_step(
            staged.batch, staged.scheduled, staged.sampled, staged.sampled_tokens, self.block_size
        )
        if forecast is not None:
            self.forecasts.add(forecast)

    def _upload(
        self, batch: ForwardBatch | None, lane: int
    ) -> tuple[ForwardBatch | None, torch.cuda.Event | None]:
        """A host-built batch on the device: with CUDA SBO copied on the data stream, with the
        event after which its copies have landed."""
        if batch is None:
            return None, None
        if self.streams is None:
            return upload_batch(batch, self.device), None
        upload = DeviceUpload(self.streams, self.streams.for_lane(lane))
        return upload_batch(batch, self.device, upload), upload.ready()

    def _scheduled(self, step: worker_pb2.Step) -> list[tuple[SeqState, int]]:
        """Every sequence the step runs, with its number of new tokens, in the step's order: its new
        sequences (now known here), then its running ones, their tables extended by the step's new
        blocks. Sequences the step releases are forgotten first."""
        try:
            running = unpack_running(step.running)
        except ValueError as err:
            raise StepError(f"step {step.step_id}: {err}") from None
        for seq_id in np.frombuffer(step.released_seq_ids, dtype="<u8").tolist():
            self.seqs.pop(seq_id, None)
        scheduled: list[tuple[SeqState, int]] = []
        for new in step.new_sequences:
            token_ids = _ints(new.token_ids)
            state = SeqState(
                seq_id=new.seq_id,
                token_ids=token_ids,
                prompt_len=new.prompt_len,
                block_table=_ints(new.block_ids),
                num_computed=new.num_computed_tokens,
                sampling=sampling_from_proto(new.sampling),
                num_known=len(token_ids),
            )
            self.seqs[new.seq_id] = state
            scheduled.append((state, new.num_new_tokens))
        for seq_id, computed, num_new, blocks in zip(
            running.seq_ids.tolist(),
            running.num_computed_tokens.tolist(),
            running.num_new_tokens.tolist(),
            running.blocks_of(),
            strict=True,
        ):
            known = self.seqs.get(seq_id)
            if known is None:
                raise StepError(f"step {step.step_id}: sequence {seq_id} is not on this worker")
            if known.num_computed != computed:
                raise StepError(
                    f"step {step.step_id}: sequence {seq_id} has {known.num_computed} computed tokens "
                    f"here, the scheduler says {computed}"
                )
            known.block_table.extend(blocks)
            scheduled.append((known, num_new))
        return scheduled

    def _stage_in_full(
        self, step: worker_pb2.Step
    ) -> tuple[
        ForwardBatch | None,
        list[SeqState],
        list[tuple[SeqState, int]],
        LateInputs | None,
        torch.cuda.Event | None,
    ]:
        """The step's batch, its sampled sequences, every sequence with its new tokens, its late
        inputs, and (CUDA SBO) the event after which its inputs are on the device."""
        scheduled = self._scheduled(step)
        chunks: list[ScheduledChunk] = []
        sampled = []
        late: list[tuple[int, SeqState, int]] = []  # chunk index, sequence, position of its input
        for state, num_new in scheduled:
            end = state.num_computed + num_new
            if num_new < 1 or end > state.num_known:
                raise StepError(
                    f"step {step.step_id}: sequence {state.seq_id} asks for tokens "
                    f"{state.num_computed}..{end} of {state.num_known}"
                )
            needs_logits = end == state.num_known
            tokens = state.token_ids[state.num_computed : end]  # one read: finish may append meanwhile
            if len(tokens) < num_new:  # a step staged before this one samples its input
                if num_new != 1:
                    raise StepError(
                        f"step {step.step_id}: sequence {state.seq_id} needs token {len(state.token_ids)}, "
                        "which a step still in progress samples (a lookahead step decodes one token)"
                    )
                late.append((len(chunks), state, state.num_computed))
                tokens = [0]
            chunks.append(ScheduledChunk(tokens, state.num_computed, state.block_table, needs_logits))
            if needs_logits:
                sampled.append(state)
            state.num_computed = end
        if not chunks:
            return None, sampled, scheduled, None, None
        if self.streams is None:
            batch = build_forward_batch(chunks, self.block_size, self.device)
            return batch, sampled, scheduled, _late_inputs(batch, late), None
        upload = DeviceUpload(self.streams, self.streams.for_lane(step.lane))
        batch = build_forward_batch(chunks, self.block_size, self.device, upload)
        return batch, sampled, scheduled, _late_inputs(batch, late), upload.ready()

    @torch.inference_mode()
    def execute(self, staged: StagedStep, yield_point: Callable[[], None] | None = None) -> PendingStep:
        """Run (on a GPU with SBO: launch) one staged step; `yield_point` runs between the model's
        blocks (see LlamaModel.forward). Pass the result to `finish`."""
        pending = PendingStep(worker_pb2.StepResult(step_id=staged.step_id, lane=staged.lane))
        if staged.batch is None:
            return pending
        slot = self.streams.slot_for_lane(staged.lane) if self.streams is not None else 0
        stream = self.streams.compute[slot] if self.streams is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:
                pending.started = torch.cuda.Event(enable_timing=True)
                pending.started.record(stream)
                if staged.ready is not None:
                    stream.wait_event(staged.ready)
            if staged.late is not None:  # the steps in front have finished: their tokens are appended
                staged.late.write(staged.batch.input_ids)
            logits = self._forward(staged.batch, slot, yield_point)  # [S, vocab] in the model's dtype
            pending.sampled = staged.sampled
            pending.sampled_tokens = staged.sampled_tokens
            rows = [
                SamplingRow(s.sampling, s.token_ids[: s.prompt_len], s.token_ids[s.prompt_len :])
                for s in staged.sampled
            ]
            if rows:
                self._sample(pending, logits, rows, stream)
            if stream is not None:
                # Also when nothing was sampled: the step's K/V must be written before its result
                # lets the scheduler send the sequence's next chunk, perhaps to another stream.
                pending.done = torch.cuda.Event(enable_timing=True)
                pending.done.record(stream)
        return pending

    def _sample(
        self,
        pending: PendingStep,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Sample the step's rows into `pending` and time the sampler: on a GPU's stream from an
        event recorded here to the step's last (see finish), elsewhere in wall time (a GPU without
        streams is waited for first: sample() waits for it anyway)."""
        if stream is not None:
            pending.sampling = torch.cuda.Event(enable_timing=True)
            pending.sampling.record(stream)
            if all(row.params.logprobs is None for row in rows):  # no host read: the copy back is queued
                chosen = self.sampler.choose(logits, rows)
                pending.tokens = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
                pending.tokens.copy_(chosen, non_blocking=True)
            else:
                pending.output = self.sampler.sample(logits, rows)
            return
        if logits.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        pending.output = self.sampler.sample(logits, rows)
        pending.result.sampling_seconds = time.perf_counter() - started

    def _forward(
        self,
        batch: ForwardBatch,
        slot: int,
        yield_point: Callable[[], None] | None,
    ) -> torch.Tensor:
        """The model's forward, or the replay of compute stream `slot`'s decode graph."""
        if self.graphs:
            graphs = self.graphs[slot]
            size = graphs.size_for(batch)
            if size is not None:
                return graphs.run(batch, size)
        return self.model(batch, self.kv_cache, yield_point)

    def finish(self, pending: PendingStep) -> worker_pb2.StepResult:
        """Wait for the step's tokens, append them to their sequences and fill in the result. On a
        GPU with SBO the result's compute time is the GPU's, from the step's two events."""
        result = pending.result
        if pending.done is not None:
            pending.done.synchronize()
            assert pending.started is not None
            result.compute_seconds = pending.started.elapsed_time(pending.done) / 1e3
            if pending.sampling is not None:
                result.sampling_seconds = pending.sampling.elapsed_time(pending.done) / 1e3
        if not pending.sampled:
            return result
        if pending.output is not None:
            token_ids, logprobs = pending.output.token_ids, pending.output.logprobs
        else:
            assert pending.tokens is not None
            token_ids, logprobs = pending.tokens.tolist(), [None] * len(pending.sampled)
        for state, token_id in zip(pending.sampled, token_ids, strict=True):
            state.token_ids.append(token_id)
        result.seq_ids = np.asarray([s.seq_id for s in pending.sampled], dtype="<u8").tobytes()
        tokens = np.asarray(token_ids, dtype=np.int64)
        if pending.sampled_tokens is not None:
            pending.sampled_tokens[:] = tokens
        result.token_ids = tokens.astype("<i4").tobytes()
        for state, entry_logprobs in zip(pending.sampled, logprobs, strict=True):
            if entry_logprobs is not None:
                entry = result.logprobs[state.seq_id]
                entry.logprob = entry_logprobs.logprob
                entry.top_token_ids = np.asarray(entry_logprobs.top_token_ids, dtype="<i4").tobytes()
                entry.top_logprobs = np.asarray(entry_logprobs.top_logprobs, dtype="<f4").tobytes()
        return result

    def run(self, staged: StagedStep) -> worker_pb2.StepResult:
        """execute + finish, for callers that want the result at once (warm-up, tests)."""
        return self.finish(self.execute(staged))

"""ModelRunner: the worker's sequence state, and one step = stage, then execute.

`stage` turns a Step message into device inputs (it may run on the staging
thread while the previous step computes); `execute` runs the forward pass and
the sampler and appends the sampled tokens. The two never touch the same
sequence concurrently: the scheduler puts a sequence in at most one in-flight
batch, and it only schedules a sequence again after its previous result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from gpu_worker.batch import ForwardBatch, ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import LlamaModel
from gpu_worker.sampler import Sampler, SamplingParams, SamplingRow
from protos import worker_pb2


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


@dataclass(slots=True)
class StagedStep:
    step_id: int
    lane: int
    batch: ForwardBatch | None  # None for a step that only releases sequences
    sampled: list[SeqState]  # sequences sampling a token, in logits-row order
    staging_seconds: float = 0.0
    staged_at: float = field(default_factory=time.perf_counter)
    traceparents: dict[int, str] = field(default_factory=dict)  # traced sequences' spans (see worker.proto)
    urgent: bool = False  # runs at the next layer boundary of the step in progress (see worker.proto)


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


class ModelRunner:
    """Runs steps on one model and KV cache."""

    def __init__(
        self, model: LlamaModel, kv_cache: KVCache, block_size: int, device: torch.device, seed: int = 0
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed=seed)
        self.seqs: dict[int, SeqState] = {}

    @property
    def has_work_in_flight(self) -> bool:
        """True while the scheduler has running sequences here (idle time then counts as waiting)."""
        return bool(self.seqs)

    def stage(self, step: worker_pb2.Step) -> StagedStep:
        started = time.perf_counter()
        for seq_id in np.frombuffer(step.released_seq_ids, dtype="<u8").tolist():
            self.seqs.pop(seq_id, None)
        scheduled: list[tuple[SeqState, int]] = []
        for new in step.new_sequences:
            state = SeqState(
                seq_id=new.seq_id,
                token_ids=_ints(new.token_ids),
                prompt_len=new.prompt_len,
                block_table=_ints(new.block_ids),
                num_computed=new.num_computed_tokens,
                sampling=sampling_from_proto(new.sampling),
            )
            self.seqs[new.seq_id] = state
            scheduled.append((state, new.num_new_tokens))
        for running in step.running:
            known = self.seqs.get(running.seq_id)
            if known is None:
                raise StepError(f"step {step.step_id}: sequence {running.seq_id} is not on this worker")
            state = known
            if state.num_computed != running.num_computed_tokens:
                raise StepError(
                    f"step {step.step_id}: sequence {running.seq_id} has {state.num_computed} computed tokens "
                    f"here, the scheduler says {running.num_computed_tokens}"
                )
            state.block_table.extend(_ints(running.new_block_ids))
            scheduled.append((state, running.num_new_tokens))

        chunks = []
        sampled = []
        for state, num_new in scheduled:
            end = state.num_computed + num_new
            if num_new < 1 or end > len(state.token_ids):
                raise StepError(
                    f"step {step.step_id}: sequence {state.seq_id} asks for tokens "
                    f"{state.num_computed}..{end} of {len(state.token_ids)}"
                )
            needs_logits = end == len(state.token_ids)
            chunks.append(
                ScheduledChunk(
                    state.token_ids[state.num_computed : end],
                    state.num_computed,
                    state.block_table,
                    needs_logits,
                )
            )
            if needs_logits:
                sampled.append(state)
            state.num_computed = end
        batch = build_forward_batch(chunks, self.block_size, self.device) if chunks else None
        return StagedStep(
            step_id=step.step_id,
            lane=step.lane,
            batch=batch,
            sampled=sampled,
            staging_seconds=time.perf_counter() - started,
            traceparents=dict(step.traceparents),
            urgent=step.urgent,
        )

    @torch.inference_mode()
    def execute(
        self, staged: StagedStep, yield_point: Callable[[], None] | None = None
    ) -> worker_pb2.StepResult:
        """Run one staged step; `yield_point` runs between the model's blocks (see LlamaModel.forward)."""
        result = worker_pb2.StepResult(step_id=staged.step_id, lane=staged.lane)
        if staged.batch is None:
            return result
        logits = self.model(staged.batch, self.kv_cache, yield_point)  # [S, vocab] float32
        if not staged.sampled:
            return result
        rows = [
            SamplingRow(s.sampling, s.token_ids[: s.prompt_len], s.token_ids[s.prompt_len :])
            for s in staged.sampled
        ]
        output = self.sampler.sample(logits, rows)
        for state, token_id in zip(staged.sampled, output.token_ids, strict=True):
            state.token_ids.append(token_id)
        result.seq_ids = np.asarray([s.seq_id for s in staged.sampled], dtype="<u8").tobytes()
        result.token_ids = np.asarray(output.token_ids, dtype="<i4").tobytes()
        for state, logprobs in zip(staged.sampled, output.logprobs, strict=True):
            if logprobs is not None:
                entry = result.logprobs[state.seq_id]
                entry.logprob = logprobs.logprob
                entry.top_token_ids = np.asarray(logprobs.top_token_ids, dtype="<i4").tobytes()
                entry.top_logprobs = np.asarray(logprobs.top_logprobs, dtype="<f4").tobytes()
        return result

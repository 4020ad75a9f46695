"""Shared by the worker tests: a tiny random Llama saved as a Hugging Face directory, and Steps."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.loader import load_model
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.pipeline import StepPipeline
from gpu_worker.runner import ModelRunner
from gpu_worker.startup import make_attention
from kernels.cpu_stack import BoundStack
from protos import worker_pb2
from protos.running import RunningEntry, pack_running

TINY_LLAMA = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,  # wide logits: no near-ties for float rounding to flip
}


def save_tiny_llama(path: Path, **overrides: Any) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A random Llama of TINY_LLAMA's shape (with `overrides`) saved at `path`, loaded back."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})).save_pretrained(
        path
    )
    return load_model(path)


def cpu_runner(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], backend: str, block_size: int
) -> ModelRunner:
    """A float32 CPU runner of the tiny model with `backend` attention and 64 KV blocks."""
    config, weights = tiny
    cpu = torch.device("cpu")
    model = LlamaModel(config, torch.float32, cpu)
    model.load_weights(weights)
    model.use_attention(make_attention(backend, config, torch.float32, cpu, block_size))
    return ModelRunner(model, allocate_kv_cache(config, 64, block_size, torch.float32, cpu), block_size, cpu)


# Greedy sampling as the scheduler sends it (validation fills in every default).
GREEDY = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def prompt_step(
    step_id: int,
    seqs: list[tuple[int, int, list[int]]],
    lane: int = 0,
    urgent: bool = False,
    vocab_size: int = 256,
) -> worker_pb2.Step:
    """A step starting sequences (seq_id, prompt_len, block ids) from scratch, whole prompts."""
    step = worker_pb2.Step(step_id=step_id, lane=lane, urgent=urgent)
    for seq_id, length, blocks in seqs:
        prompt = (np.arange(length, dtype="<i4") * 7 + seq_id) % (vocab_size - 6) + 3
        step.new_sequences.append(
            worker_pb2.NewSequence(
                seq_id=seq_id,
                token_ids=prompt.tobytes(),
                prompt_len=length,
                block_ids=np.asarray(blocks, dtype="<i4").tobytes(),
                num_new_tokens=length,
                sampling=GREEDY,
            )
        )
    return step


def decode_step(step_id: int, lane: int, computed: dict[int, int]) -> worker_pb2.Step:
    step = worker_pb2.Step(step_id=step_id, lane=lane)
    step.running.CopyFrom(pack_running([RunningEntry(seq_id, n, 1) for seq_id, n in computed.items()]))
    return step


def tokens_of(result: worker_pb2.StepResult) -> dict[int, int]:
    seq_ids = np.frombuffer(result.seq_ids, "<u8").tolist()
    return dict(zip(seq_ids, np.frombuffer(result.token_ids, "<i4").tolist(), strict=True))


# Two DBO lanes: lane 0 runs sequences 1-3, lane 1 sequences 4-5 (seq_id, prompt length, blocks of
# 16 tokens, enough for 13 more).
TWO_LANES = {
    0: [(1, 40, [0, 1, 2, 3]), (2, 7, [4, 5]), (3, 19, [6, 7])],
    1: [(4, 33, [8, 9, 10]), (5, 2, [11])],
}

_addresses = itertools.count()


def two_lanes_through_pipeline(
    make_pipeline: Callable[[zmq.Socket], StepPipeline], decodes: int, vocab_size: int
) -> tuple[dict[int, list[int]], list[worker_pb2.StepResult]]:
    """Drive a real StepPipeline over a socket as the scheduler drives DBO: both lanes' prompts at
    once, then each lane's next decode step as soon as its previous result is back, `decodes` per
    lane. Returns every sequence's tokens and the results in arrival order."""
    with pipeline_thread(make_pipeline) as scheduler_side:
        return _drive_two_lanes(scheduler_side, decodes, vocab_size)


def _drive_two_lanes(
    scheduler_side: zmq.Socket, decodes: int, vocab_size: int
) -> tuple[dict[int, list[int]], list[worker_pb2.StepResult]]:
    def send(step: worker_pb2.Step) -> None:
        scheduler_side.send(worker_pb2.SchedulerMessage(step=step).SerializeToString())

    tokens: dict[int, list[int]] = {}
    results: list[worker_pb2.StepResult] = []
    computed = {seq_id: length for seqs in TWO_LANES.values() for seq_id, length, _ in seqs}
    left = dict.fromkeys(TWO_LANES, decodes)
    step_ids = itertools.count(1)
    for lane, seqs in TWO_LANES.items():
        send(prompt_step(next(step_ids), seqs, lane=lane, vocab_size=vocab_size))
    outstanding = len(TWO_LANES)
    while outstanding:
        assert scheduler_side.poll(30_000), "the pipeline stopped answering"
        message = worker_pb2.WorkerMessage.FromString(scheduler_side.recv())
        assert message.WhichOneof("kind") == "result", message
        result = message.result
        results.append(result)
        outstanding -= 1
        for seq_id, token in tokens_of(result).items():
            tokens.setdefault(seq_id, []).append(token)
            computed[seq_id] += 1
        if left[result.lane]:
            left[result.lane] -= 1
            mine = {seq_id: computed[seq_id] - 1 for seq_id, _, _ in TWO_LANES[result.lane]}
            send(decode_step(next(step_ids), result.lane, mine))
            outstanding += 1
    # A step naming a sequence the worker does not hold gets an error naming the step.
    send(decode_step(999, 0, {77: 3}))
    assert scheduler_side.poll(30_000)
    error = worker_pb2.WorkerMessage.FromString(scheduler_side.recv())
    assert error.WhichOneof("kind") == "error" and error.error.step_id == 999, error
    assert "sequence 77" in error.error.message
    return tokens, results


@contextlib.contextmanager
def pipeline_thread(make_pipeline: Callable[[zmq.Socket], StepPipeline]) -> Iterator[zmq.Socket]:
    """The pipeline `make_pipeline` makes, run on a thread of its own over an inproc socket pair:
    yields the scheduler's side, then sends Shutdown and checks that the pipeline stopped."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    address = f"inproc://duoserve-test-pipeline-{next(_addresses)}"
    scheduler_side = context.socket(zmq.PAIR)
    scheduler_side.bind(address)
    worker_side = context.socket(zmq.PAIR)
    worker_side.connect(address)
    thread = threading.Thread(target=make_pipeline(worker_side).run, daemon=True)
    thread.start()
    try:
        yield scheduler_side
    finally:
        scheduler_side.send(worker_pb2.SchedulerMessage(shutdown=worker_pb2.Shutdown()).SerializeToString())
        thread.join(timeout=30)
        scheduler_side.close(linger=0)
        worker_side.close(linger=0)
    assert not thread.is_alive(), "the pipeline did not stop on Shutdown"


def assert_same_record(
    ours: Any,
    theirs: Any,
    where: str,
    same: Callable[[torch.Tensor, torch.Tensor], bool] = torch.equal,
) -> None:
    """Every field of two batch records equal: tensors by `same` (default: element for element),
    the decode metadata and each prefill field by field, the rest by value."""
    for field_ in dataclasses.fields(ours):
        a, b, name = getattr(ours, field_.name), getattr(theirs, field_.name), f"{where}.{field_.name}"
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same(a, b), (name, a, b)
        elif dataclasses.is_dataclass(a) or dataclasses.is_dataclass(b):
            assert dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b), (name, a, b)
            assert_same_record(a, b, name, same)
        elif field_.name == "prefills":
            assert len(a) == len(b), name
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                assert_same_record(x, y, f"{name}[{i}]", same)
        else:
            assert a == b, (name, a, b)


@dataclass(slots=True)
class Seq:
    tokens: list[int]
    blocks: list[int]
    computed: int = 0


@dataclass(slots=True)
class SchedulerScript:
    """The scheduler's side: sequences, their block tables (a block added only when needed) and steps."""

    block_size: int
    seqs: dict[int, Seq] = field(default_factory=dict)
    next_block: int = 1  # block 0 stays free: the forecast's stand-in must never reach a kernel
    step_id: int = 0

    def blocks_for(self, count: int) -> list[int]:
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    def prompt_step(
        self,
        prompts: dict[int, int],
        lane: int = 0,
        chunk: int = 0,
        running: list[RunningEntry] | None = None,
    ) -> worker_pb2.Step:
        """New sequences' prompts (their first `chunk` tokens when given), and `running` after them."""
        self.step_id += 1
        step = worker_pb2.Step(step_id=self.step_id, lane=lane)
        for seq_id, length in prompts.items():
            tokens = [(seq_id * 31 + 7 * i) % 250 + 3 for i in range(length)]
            first = min(chunk or length, length)
            seq = self.seqs[seq_id] = Seq(tokens, self.blocks_for(-(-first // self.block_size)), first)
            step.new_sequences.append(
                worker_pb2.NewSequence(
                    seq_id=seq_id,
                    token_ids=np.asarray(tokens, dtype="<i4").tobytes(),
                    prompt_len=length,
                    block_ids=np.asarray(seq.blocks, dtype="<i4").tobytes(),
                    num_new_tokens=first,
                    sampling=GREEDY,
                )
            )
        if running:
            step.running.CopyFrom(pack_running(running))
            for entry in running:
                self.seqs[entry.seq_id].blocks.extend(entry.new_block_ids)
        return step

    def window(self, seq_id: int, length: int) -> RunningEntry:
        """The next `length` tokens of a prompt, with the blocks they need."""
        seq = self.seqs[seq_id]
        needed = -(-(seq.computed + length) // self.block_size)
        entry = RunningEntry(seq_id, seq.computed, length, self.blocks_for(needed - len(seq.blocks)))
        seq.computed += length
        return entry

    def decode_entries(self, seq_ids: list[int], ahead: int = 0) -> list[RunningEntry]:
        """Each sequence's next decode, with a block added where its new token starts one. `ahead`:
        steps in flight that sample for each of them first (a lookahead step decodes their token)."""
        entries = []
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            position = len(seq.tokens) - 1 + ahead
            new = self.blocks_for(1) if position == len(seq.blocks) * self.block_size else []
            entries.append(RunningEntry(seq_id, position, 1, new))
        return entries

    def step(self, entries: list[RunningEntry], lane: int = 0, **fields: object) -> worker_pb2.Step:
        self.step_id += 1
        step = worker_pb2.Step(step_id=self.step_id, lane=lane, running=pack_running(entries), **fields)
        for entry in entries:
            self.seqs[entry.seq_id].blocks.extend(entry.new_block_ids)
        return step

    def take_tokens(self, result: worker_pb2.StepResult) -> None:
        for seq_id, token in tokens_of(result).items():
            self.seqs[seq_id].tokens.append(token)


class CountingRuns:
    """Counts BoundStack.run calls (decode steps that took a one-call decode stack), and says for
    each whether that stack multiplied on blocks (`on_blocks`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs = 0
        self.on_blocks: list[bool] = []
        original = BoundStack.run

        def run(bound: BoundStack, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.runs += 1
            self.on_blocks.append(bound.stack.blocks)
            return original(bound, *args, **kwargs)

        monkeypatch.setattr(BoundStack, "run", run)


def plain_tokens(runner: ModelRunner, decodes: int) -> dict[int, list[int]]:
    """TWO_LANES' sequences in one lane, each step run before the next is staged."""
    seqs = [seq for lane in TWO_LANES.values() for seq in lane]
    out: dict[int, list[int]] = {}
    staged = runner.stage(prompt_step(1, seqs, vocab_size=256))
    positions = {seq_id: length for seq_id, length, _ in seqs}
    for step_id in range(2, decodes + 3):
        for seq_id, token in tokens_of(runner.run(staged)).items():
            out.setdefault(seq_id, []).append(token)
        if step_id <= decodes + 1:
            staged = runner.stage(decode_step(step_id, 0, positions))
            positions = {seq_id: position + 1 for seq_id, position in positions.items()}
    return out


def drive_with_lookahead(scheduler_side: zmq.Socket, decodes: int) -> tuple[dict, list]:
    """As the scheduler drives one lane with lookahead: the prompts, at once their decode, and
    each next decode as soon as a result frees a place, so two steps are always in flight."""
    seqs = [seq for lane in TWO_LANES.values() for seq in lane]
    step_ids = itertools.count(1)

    def send(step: worker_pb2.Step) -> None:
        scheduler_side.send(worker_pb2.SchedulerMessage(step=step).SerializeToString())

    send(prompt_step(next(step_ids), seqs, vocab_size=256))
    positions = {seq_id: length for seq_id, length, _ in seqs}  # where each next step starts
    left, outstanding = decodes, 1
    tokens: dict[int, list[int]] = {}
    results: list[worker_pb2.StepResult] = []
    while outstanding:
        while left and outstanding < 2:
            send(decode_step(next(step_ids), 0, positions))
            positions = {seq_id: position + 1 for seq_id, position in positions.items()}
            left, outstanding = left - 1, outstanding + 1
        assert scheduler_side.poll(30_000), "the pipeline stopped answering"
        message = worker_pb2.WorkerMessage.FromString(scheduler_side.recv())
        assert message.WhichOneof("kind") == "result", message
        results.append(message.result)
        outstanding -= 1
        for seq_id, token in tokens_of(message.result).items():
            tokens.setdefault(seq_id, []).append(token)
    return tokens, results

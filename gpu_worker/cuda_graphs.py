"""CUDA graphs for decode steps: one captured forward per batch size, replayed instead of launched.

A decode step of a small model is bound by launching its kernels (hundreds per step), not by
running them. At start the worker captures the forward of a decode-only batch at each size in
`graph_batch_sizes`; a step whose chunks are all single tokens needing logits then copies its
inputs into the graph's static buffers and replays the graph of the smallest size that holds it.
Rows past the step's own are padding: their K/V write is skipped (slot -1) and their logits are
never read.

The decode kernel's split count depends on the longest context, a host-side number, so graphs
are captured for the model's full context length: a replay handles any context the scheduler
can send.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from gpu_worker.batch import DecodeAttention, ForwardBatch
from gpu_worker.kv_cache import KVCache
from gpu_worker.model import LlamaModel

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, then powers of two; the last is `max_batch`."""
    if max_batch < 1:
        return []
    sizes = [1, 2, 4, *range(8, 65, 8)]
    size = 128
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def replayable(batch: ForwardBatch) -> bool:
    """A decode-only step: every chunk one token, every chunk sampling."""
    return (
        batch.decode is not None
        and not batch.prefills
        and batch.decode.num_seqs == batch.num_tokens
        and batch.num_logits == batch.num_tokens
    )


class DecodeGraphs:
    """Captured decode forwards, one per batch size, sharing one memory pool and one set of inputs."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        block_size: int,
        max_context: int,
        sizes: Sequence[int],
    ) -> None:
        assert model.device.type == "cuda", "CUDA graphs need a CUDA model"
        assert sizes, "at least one batch size to capture"
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_blocks = -(-max_context // block_size)
        self.max_context = self.max_blocks * block_size
        self.sizes = sorted(sizes)
        largest = self.sizes[-1]
        device = model.device
        # Static inputs, sized for the largest graph; each graph reads a prefix of them.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.rows = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0

    def capture(self) -> float:
        """Capture every size, largest first (later ones reuse its memory); returns the seconds taken."""
        started = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            batch = self._static_batch(size)
            stream = torch.cuda.Stream(self.model.device)
            stream.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles and tunes kernels, outside the graph
                    self.model(batch, self.kv_cache)
            torch.cuda.current_stream(self.model.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.model(batch, self.kv_cache)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.model.device)
        seconds = time.perf_counter() - started
        log.info("captured CUDA graphs for decode batches of %s in %.1f s", self.sizes, seconds)
        return seconds

    def size_for(self, batch: ForwardBatch) -> int | None:
        """The graph a step would replay, or None when it runs eagerly."""
        if not self.graphs or not replayable(batch):
            return None
        assert batch.decode is not None
        if batch.decode.max_context > self.max_context:
            return None
        num = batch.num_tokens
        return next((size for size in self.sizes if size >= num), None)

    def run(self, batch: ForwardBatch, size: int) -> torch.Tensor:  # [S, vocab] in the model's dtype
        """Replay the graph of `size` (from `size_for`) on `batch`'s inputs."""
        assert batch.decode is not None
        num = batch.num_tokens
        tables = batch.decode.block_tables
        self.input_ids[:num].copy_(batch.input_ids)
        self.positions[:num].copy_(batch.positions)
        self.slot_mapping[:num].copy_(batch.slot_mapping)
        self.block_tables[:num, : tables.shape[1]].copy_(tables)
        self.context_lens[:num].copy_(batch.decode.context_lens)
        if num < size:  # padding rows: no K/V write, one (ignored) key each
            self.slot_mapping[num:size].fill_(-1)
            self.context_lens[num:size].fill_(1)
        self.graphs[size].replay()
        self.replays += 1
        # The logits rows are in batch order; a decode batch keeps its chunks' order (chunk_order).
        return self.logits[size][:num]

    def _static_batch(self, size: int) -> ForwardBatch:
        empty = torch.empty(0, dtype=torch.int64, device=self.model.device)
        decode = DecodeAttention(
            num_seqs=size,
            max_context=self.max_context,
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            key_blocks=empty,  # the torch path's gather inputs; the Triton backend reads the tables
            key_mask=empty.bool(),
        )
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            logits_indices=self.rows[:size],
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.model.device),
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            chunk_order=tuple(range(size)),
            block_size=self.block_size,
            decode=decode,
            prefills=(),
        )

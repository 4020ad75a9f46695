"""Applies a worker step result to its requests: tokens, text, stop checks, events."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from protos import inference_pb2, worker_pb2
from scheduler.planner import ScheduledSeq
from scheduler.request import FinishReason, OutputEvent, Request


@dataclass(slots=True)
class InflightBatch:
    step_id: int
    lane: int
    seqs: list[ScheduledSeq]


class OutputProcessor:
    """Turns sampled token ids into streamed text and finish decisions."""

    def __init__(self, eos_token_ids: Iterable[int], context_length: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length

    def process(self, batch: InflightBatch, result: worker_pb2.StepResult) -> list[Request]:
        """Apply `result` to the batch's requests; returns those that finished."""
        by_seq: dict[int, Request] = {}
        for scheduled in batch.seqs:
            request = scheduled.request
            request.in_flight = False
            request.num_computed_tokens += scheduled.num_new_tokens
            by_seq[request.seq_id] = request
        seq_ids = np.frombuffer(result.seq_ids, dtype="<u8")
        token_ids = np.frombuffer(result.token_ids, dtype="<i4")
        assert len(seq_ids) == len(token_ids), "step result: seq_ids and token_ids differ in length"
        finished = [r for r in by_seq.values() if r.aborted]
        for seq_id, token_id in zip(seq_ids.tolist(), token_ids.tolist(), strict=True):
            assert seq_id in by_seq, f"step {batch.step_id}: result for sequence {seq_id} it did not carry"
            request = by_seq[seq_id]
            if request.aborted:
                continue
            logprobs = result.logprobs.get(seq_id) if seq_id in result.logprobs else None
            if self._apply_token(request, token_id, logprobs):
                finished.append(request)
        return finished

    def _apply_token(
        self, request: Request, token_id: int, logprobs: worker_pb2.SequenceLogprobs | None
    ) -> bool:
        """Append one sampled token, emit its event; True when the request is finished."""
        params = request.params
        request.output_token_ids.append(token_id)
        request.preemptions_in_a_row = 0
        event = OutputEvent(token_ids=[token_id])
        if logprobs is not None:
            event.logprobs.append(_token_logprob(token_id, logprobs))

        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            event.text = request.detokenizer.flush()
            event.finish_reason = FinishReason.STOP
        else:
            event.text = request.detokenizer.push(token_id)
            if request.detokenizer.stopped:
                event.finish_reason = FinishReason.STOP
            elif (
                len(request.output_token_ids) >= params.max_tokens
                or request.num_tokens >= self.context_length
            ):
                event.text += request.detokenizer.flush()
                # The held-back tail may itself complete a stop string.
                event.finish_reason = (
                    FinishReason.STOP if request.detokenizer.stopped else FinishReason.LENGTH
                )
        request.finish_reason = event.finish_reason
        request.emit(event)
        return event.finish_reason is not None


def _token_logprob(token_id: int, logprobs: worker_pb2.SequenceLogprobs) -> inference_pb2.TokenLogprob:
    top_ids = np.frombuffer(logprobs.top_token_ids, dtype="<i4").tolist()
    top_values = np.frombuffer(logprobs.top_logprobs, dtype="<f4").tolist()
    return inference_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprobs.logprob,
        top=[
            inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(top_ids, top_values, strict=True)
        ],
    )

"""Applies a worker step result to its requests: tokens, text, stop checks, events."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from protos import inference_pb2, worker_pb2
from scheduler.planner import ScheduledSeq
from scheduler.request import FinishReason, OutputEvent, Request, RequestState


@dataclass(slots=True)
class InflightBatch:
    step_id: int
    lane: int
    seqs: list[ScheduledSeq]
    sent_at: float = 0.0  # monotonic


@dataclass(slots=True)
class NewToken:
    """A sampled token applied to its request, whose event is still to be built."""

    request: Request
    token_id: int
    logprobs: worker_pb2.SequenceLogprobs | None
    finished: bool  # by a stop token, EOS, max_tokens or the context length


class OutputProcessor:
    """Turns sampled token ids into finish decisions, then into streamed text.

    Two phases, so that the scheduler can dispatch the next step between them: `apply`
    appends the tokens and decides every finish that needs no text (EOS, stop tokens,
    max_tokens, context length); `emit` detokenizes, checks stop strings and sends events.
    """

    def __init__(self, eos_token_ids: Iterable[int], context_length: int, stream_interval: int = 1) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = context_length
        self.stream_interval = stream_interval  # tokens an event carries after the first (Request.emit)

    def apply(
        self, batch: InflightBatch, result: worker_pb2.StepResult
    ) -> tuple[list[Request], list[NewToken]]:
        """Advance the batch's requests by `result`: (requests now finished, tokens to emit).

        A finished request may still be in a lookahead step (see BatchPlanner): the caller ends it
        when that comes back. Requests already ended while in flight (the server stopping) are
        left alone, and an aborted one is returned as finished once no step carries it."""
        by_seq: dict[int, Request] = {}
        finished = []
        for scheduled in batch.seqs:
            request = scheduled.request
            by_seq[request.seq_id] = request
            if request.state is RequestState.FINISHED:
                continue  # ended while in flight (aborted): nothing left to do
            request.returned(scheduled.num_new_tokens, scheduled.samples)
            if request.aborted and not request.in_flight:
                finished.append(request)
        seq_ids = np.frombuffer(result.seq_ids, dtype="<u8")
        token_ids = np.frombuffer(result.token_ids, dtype="<i4")
        assert len(seq_ids) == len(token_ids), "step result: seq_ids and token_ids differ in length"
        tokens = []
        for seq_id, token_id in zip(seq_ids.tolist(), token_ids.tolist(), strict=True):
            assert seq_id in by_seq, f"step {batch.step_id}: result for sequence {seq_id} it did not carry"
            request = by_seq[seq_id]
            if request.aborted:
                continue
            params = request.params
            request.output_token_ids.append(token_id)
            request.preemptions_in_a_row = 0
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
                if request.trace is not None:
                    request.trace.token(0)
            done = (
                token_id in params.stop_token_ids
                or (token_id in self.eos_token_ids and not params.ignore_eos)
                or len(request.output_token_ids) >= params.max_tokens
                or request.num_tokens >= self.context_length
            )
            if done:
                finished.append(request)
            logprobs = result.logprobs.get(seq_id) if seq_id in result.logprobs else None
            tokens.append(NewToken(request, token_id, logprobs, done))
        return finished, tokens

    def emit(self, tokens: list[NewToken]) -> list[Request]:
        """Send each token's event; returns the requests a stop string finished (not known to `apply`)."""
        stopped = []
        for new in tokens:
            if self._emit_one(new) and not new.finished:
                stopped.append(new.request)
        return stopped

    def _emit_one(self, new: NewToken) -> bool:
        """Build and send one token's event; True when it ends the request."""
        request, token_id = new.request, new.token_id
        params = request.params
        event = OutputEvent(token_ids=[token_id])
        if new.logprobs is not None:
            event.logprobs.append(_token_logprob(token_id, new.logprobs))
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            event.text = request.detokenizer.flush()
            event.finish_reason = FinishReason.STOP
        else:
            event.text = request.detokenizer.push(token_id)
            if request.detokenizer.stopped:
                event.finish_reason = FinishReason.STOP
            elif new.finished:  # max_tokens or the context length
                event.text += request.detokenizer.flush()
                # The held-back tail may itself complete a stop string.
                event.finish_reason = (
                    FinishReason.STOP if request.detokenizer.stopped else FinishReason.LENGTH
                )
        request.finish_reason = event.finish_reason
        request.emit(event, self.stream_interval)
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

"""One generation request as the scheduler tracks it, and the events it streams."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protos import inference_pb2, worker_pb2
from scheduler.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from scheduler.tracing import RequestTrace


class FinishReason(enum.Enum):
    STOP = inference_pb2.FINISH_REASON_STOP
    LENGTH = inference_pb2.FINISH_REASON_LENGTH
    ABORTED = inference_pb2.FINISH_REASON_ABORTED


class RequestState(enum.Enum):
    WAITING = "waiting"  # in the prefill queue (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestParams:
    """Validated per-request generation parameters."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling: worker_pb2.SamplingParams = field(default_factory=worker_pb2.SamplingParams)
    priority: int = 1  # class rank: 0 interactive, 1 standard, 2 batch
    deadline_ms: int | None = None  # from arrival; None = only the call's own deadline


@dataclass(slots=True)
class OutputEvent:
    """What a request produced since its previous event; `finish_reason` marks the last one.

    `error` (a gRPC status code name and message) ends the request without a result.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[inference_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: tuple[str, str] | None = None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    seq_id: int
    prompt_token_ids: list[int]
    params: RequestParams
    detokenizer: IncrementalDetokenizer
    events: asyncio.Queue[OutputEvent]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    # Tokens whose K/V sit in the cache; the rest of prompt + output is still to compute.
    num_computed_tokens: int = 0
    on_worker: bool = False  # the worker holds this sequence's state
    # In-flight batches that carry it (two when a lookahead step follows the one computing), the
    # tokens they compute for it and the tokens they sample for it (see BatchPlanner, lookahead).
    inflight_steps: int = 0
    inflight_tokens: int = 0
    inflight_samples: int = 0
    aborted: bool = False  # ended: whatever in-flight steps still compute for it is dropped
    num_preemptions: int = 0
    preemptions_in_a_row: int = 0  # since it last produced a token
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefix cache held at first admission
    finish_reason: FinishReason | None = None
    deadline_timer: asyncio.TimerHandle | None = None
    first_scheduled_time: float | None = None  # monotonic: its first step was dispatched
    first_token_time: float | None = None  # monotonic
    trace: RequestTrace | None = None  # set when this request is traced
    # Tokens held back for the next event (--stream-interval), and events queued so far.
    held: OutputEvent | None = None
    events_queued: int = 0
    # False for a caller that reads the events only when the request ends (a unary call): they are
    # kept in `unsent` and queued together then, so it wakes once, not once a token.
    streamed: bool = True
    unsent: list[OutputEvent] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_flight(self) -> bool:
        """Part of a batch the worker has not answered yet."""
        return self.inflight_steps > 0

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed by in-flight steps: where its next step starts."""
        return self.num_computed_tokens + self.inflight_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens known (prompt, output, and those in-flight steps sample) that no step computes yet."""
        return self.num_tokens + self.inflight_samples - self.num_scheduled_tokens

    @property
    def is_decoding(self) -> bool:
        """Its next step decodes one token (counting what in-flight steps compute and sample)."""
        return self.num_scheduled_tokens >= self.prompt_len and self.num_unscheduled_tokens == 1

    @property
    def output_tokens_to_come(self) -> int:
        """Tokens it may still sample beyond those in-flight steps sample (max_tokens bounds them;
        validation keeps prompt + max_tokens within the context length)."""
        return self.params.max_tokens - len(self.output_token_ids) - self.inflight_samples

    def joined(self, num_new_tokens: int, samples: bool) -> None:
        """Dispatched in a batch that computes `num_new_tokens` of it and samples one if `samples`."""
        self.inflight_steps += 1
        self.inflight_tokens += num_new_tokens
        self.inflight_samples += samples

    def returned(self, num_new_tokens: int, samples: bool) -> None:
        """That batch's result came back: its tokens are computed (the sampled one is appended apart)."""
        assert self.inflight_steps > 0, f"request {self.request_id} returned from a step it was not in"
        self.inflight_steps -= 1
        self.inflight_tokens -= num_new_tokens
        self.inflight_samples -= samples
        self.num_computed_tokens += num_new_tokens

    def forget_inflight(self) -> None:
        """Nothing it was in is in flight any more (the worker is gone, or the server stops)."""
        self.inflight_steps = self.inflight_tokens = self.inflight_samples = 0

    @property
    def deadline(self) -> float | None:
        """Monotonic time at which the request fails with DEADLINE_EXCEEDED, if it has a deadline."""
        if self.params.deadline_ms is None:
            return None
        return self.arrival_time + self.params.deadline_ms / 1000

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def emit(self, event: OutputEvent, interval: int = 1) -> None:
        """Queue `event` for the caller. With `interval` > 1, tokens after the first are held and
        sent `interval` at a time (the first goes at once, for the time to first token): an event
        goes out once it carries that many tokens, or ends the request. An error goes out at once,
        behind whatever tokens were held. A request that is not `streamed` keeps its events
        until one ends it or fails it, and then queues them all."""
        if not self.streamed:
            self.unsent.append(event)
            if event.error is not None or event.finish_reason is not None:
                for kept in self.unsent:
                    self._queue(kept)
                self.unsent.clear()
            return
        held, self.held = self.held, None
        if event.error is not None:
            if held is not None:
                self._queue(held)
            self._queue(event)
            return
        if held is not None:
            held.text += event.text
            held.token_ids += event.token_ids
            held.logprobs += event.logprobs
            held.finish_reason = event.finish_reason
            event = held
        if event.finish_reason is None and self.events_queued and len(event.token_ids) < interval:
            self.held = event
            return
        self._queue(event)

    def _queue(self, event: OutputEvent) -> None:
        self.events_queued += 1
        self.events.put_nowait(event)

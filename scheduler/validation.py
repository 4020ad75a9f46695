"""Validation of client requests at the edge: every bad field is named.

Turns a GenerateRequest into prompt token ids and RequestParams, or raises
InvalidRequest, which the servicer answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from protos import inference_pb2, worker_pb2
from scheduler.request import RequestParams
from scheduler.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_PROMPT_CHARS = 4_000_000
MAX_MESSAGES = 1024
MAX_DEADLINE_MS = 24 * 3600 * 1000
PRIORITY_RANKS = {
    inference_pb2.PRIORITY_UNSPECIFIED: 1,
    inference_pb2.PRIORITY_INTERACTIVE: 0,
    inference_pb2.PRIORITY_STANDARD: 1,
    inference_pb2.PRIORITY_BATCH: 2,
}


class InvalidRequest(ValueError):
    """A request field is invalid; str() starts with the field's name."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    context_length: int
    vocab_size: int
    kv_capacity_tokens: int


def check_model(name: str, limits: ModelLimits) -> None:
    if name and name != limits.name:
        raise InvalidRequest("model", f"unknown model {name!r}; this server serves {limits.name!r}")


def render_messages(messages: Sequence[inference_pb2.ChatMessage], tokenizer: Tokenizer) -> str:
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest("messages", f"{len(messages)} messages; at most {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if not message.role:
            raise InvalidRequest(f"messages[{index}].role", "empty; use system, user or assistant")
    try:
        return tokenizer.apply_chat_template(
            [(m.role, m.content) for m in messages], add_generation_prompt=True
        )
    except ValueError as err:
        raise InvalidRequest("messages", str(err)) from err


def prompt_token_ids(
    request: inference_pb2.GenerateRequest, tokenizer: Tokenizer, vocab_size: int
) -> list[int]:
    given = [
        name
        for name, present in (
            ("prompt", bool(request.prompt)),
            ("prompt_token_ids", bool(request.prompt_token_ids)),
            ("messages", bool(request.messages)),
        )
        if present
    ]
    if not given:
        raise InvalidRequest("prompt", "empty; set one of prompt, prompt_token_ids or messages")
    if len(given) > 1:
        raise InvalidRequest(
            given[1], f"set only one of prompt, prompt_token_ids and messages (got {', '.join(given)})"
        )
    if request.prompt_token_ids:
        ids = list(request.prompt_token_ids)
        for index, token_id in enumerate(ids):
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"prompt_token_ids[{index}]",
                    f"token id {token_id} is outside the vocabulary 0..{vocab_size - 1}",
                )
        return ids
    if request.messages:
        text = render_messages(request.messages, tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
        field = "messages"
    else:
        if len(request.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequest("prompt", f"{len(request.prompt)} characters; at most {MAX_PROMPT_CHARS}")
        ids = tokenizer.encode(request.prompt, add_special_tokens=True)
        field = "prompt"
    if not ids:
        raise InvalidRequest(field, "encodes to no tokens")
    return ids


def _optional(request: inference_pb2.GenerateRequest, name: str, default: float) -> float:
    return getattr(request, name) if request.HasField(name) else default


def _check_range(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    if not math.isfinite(value):
        raise InvalidRequest(name, f"{value} is not a finite number")
    below = value <= low if low_open else value < low
    if below or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidRequest(name, f"{value:g} is outside {interval}")


def sampling_params(request: inference_pb2.GenerateRequest, vocab_size: int) -> worker_pb2.SamplingParams:
    temperature = _optional(request, "temperature", 0.0)
    top_p = _optional(request, "top_p", 1.0)
    min_p = _optional(request, "min_p", 0.0)
    repetition_penalty = _optional(request, "repetition_penalty", 1.0)
    presence_penalty = _optional(request, "presence_penalty", 0.0)
    frequency_penalty = _optional(request, "frequency_penalty", 0.0)
    _check_range("temperature", temperature, 0.0, MAX_TEMPERATURE)
    _check_range("top_p", top_p, 0.0, 1.0, low_open=True)
    _check_range("min_p", min_p, 0.0, 1.0)
    _check_range("repetition_penalty", repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True)
    _check_range("presence_penalty", presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", frequency_penalty, -2.0, 2.0)
    if request.top_k > vocab_size:
        raise InvalidRequest("top_k", f"{request.top_k} exceeds the vocabulary size {vocab_size}")
    if request.HasField("logprobs") and request.logprobs > MAX_LOGPROBS:
        raise InvalidRequest("logprobs", f"{request.logprobs} is more than {MAX_LOGPROBS}")
    return worker_pb2.SamplingParams(
        temperature=temperature,
        top_k=request.top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        has_seed=request.HasField("seed"),
        seed=request.seed,
        want_logprobs=request.HasField("logprobs"),
        logprobs=request.logprobs,
    )


def check_stops(request: inference_pb2.GenerateRequest, vocab_size: int) -> None:
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"{len(request.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for index, stop in enumerate(request.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"stop[{index}]", f"length {len(stop)}; allowed 1..{MAX_STOP_STRING_CHARS}")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            "stop_token_ids", f"{len(request.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
        )
    for index, token_id in enumerate(request.stop_token_ids):
        if token_id >= vocab_size:
            raise InvalidRequest(
                f"stop_token_ids[{index}]",
                f"token id {token_id} is outside the vocabulary 0..{vocab_size - 1}",
            )


def max_tokens(
    request: inference_pb2.GenerateRequest, prompt_len: int, limits: ModelLimits, default: int
) -> int:
    room = min(limits.context_length, limits.kv_capacity_tokens) - prompt_len
    if room <= 0:
        raise InvalidRequest(
            "prompt",
            f"{prompt_len} tokens leave no room to generate (context length {limits.context_length}, "
            f"KV cache {limits.kv_capacity_tokens} tokens)",
        )
    if not request.HasField("max_tokens"):
        return min(default, room)
    if request.max_tokens < 1:
        raise InvalidRequest("max_tokens", "must be at least 1")
    if request.max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({request.max_tokens}) exceeds "
            f"the context length ({limits.context_length}) or the KV cache ({limits.kv_capacity_tokens} tokens)",
        )
    return request.max_tokens


def priority_rank(request: inference_pb2.GenerateRequest) -> int:
    if request.priority not in PRIORITY_RANKS:
        raise InvalidRequest(
            "priority", f"unknown value {request.priority}; use interactive (1), standard (2) or batch (3)"
        )
    return PRIORITY_RANKS[request.priority]


def deadline_ms(request: inference_pb2.GenerateRequest) -> int | None:
    if not request.HasField("deadline_ms"):
        return None
    if not 1 <= request.deadline_ms <= MAX_DEADLINE_MS:
        raise InvalidRequest("deadline_ms", f"{request.deadline_ms} is outside 1..{MAX_DEADLINE_MS}")
    return request.deadline_ms


def validate_generate(
    request: inference_pb2.GenerateRequest, tokenizer: Tokenizer, limits: ModelLimits, default_max_tokens: int
) -> tuple[list[int], RequestParams]:
    """Prompt token ids and generation parameters of a valid request; InvalidRequest otherwise."""
    check_model(request.model, limits)
    sampling = sampling_params(request, limits.vocab_size)
    check_stops(request, limits.vocab_size)
    ids = prompt_token_ids(request, tokenizer, limits.vocab_size)
    params = RequestParams(
        max_tokens=max_tokens(request, len(ids), limits, default_max_tokens),
        stop=tuple(request.stop),
        stop_token_ids=frozenset(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        sampling=sampling,
        priority=priority_rank(request),
        deadline_ms=deadline_ms(request),
    )
    return ids, params

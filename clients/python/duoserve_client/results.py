"""Typed records the SDK returns, and their conversion from the wire messages."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from duoserve_client._proto import inference_pb2

_FINISH_REASONS: dict[int, str] = {
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
    inference_pb2.FINISH_REASON_ABORTED: "aborted",
}


@dataclass(slots=True)
class Message:
    """One chat turn: ``role`` is "system", "user" or "assistant"."""

    role: str
    content: str


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's logprob and the ``top`` (token_id, logprob) pairs, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Completion:
    """A whole completion; ``finish_reason`` is "stop", "length" or "aborted"."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None


@dataclass(slots=True)
class CompletionChunk:
    """What a stream added since its previous chunk; the last one has finish_reason and usage."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    usage: Usage | None


@dataclass(slots=True)
class ModelInfo:
    """A served model and its serving configuration, as ListModels reports it."""

    name: str
    context_length: int
    dtype: str
    attention_backend: str
    block_size: int
    kv_cache_blocks: int
    kv_cache_tokens: int
    vocab_size: int
    num_workers: int
    kv_cache_dtype: str = ""  # what the KV cache stores: the dtype, or "int8"; "" from an older server


def finish_reason_name(value: int) -> str | None:
    """ "stop" / "length" / "aborted"; None for UNSPECIFIED (not finished); "unknown" otherwise."""
    if value == inference_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return _FINISH_REASONS.get(value, "unknown")


def usage_from_proto(usage: inference_pb2.Usage) -> Usage:
    """Convert a wire Usage."""
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_prompt_tokens,
    )


def logprobs_from_proto(items: Iterable[inference_pb2.TokenLogprob]) -> list[TokenLogprob] | None:
    """Convert wire logprobs; None when the response carries none (logprobs were not requested)."""
    converted = [
        TokenLogprob(
            token_id=item.token_id,
            logprob=item.logprob,
            top=[(top.token_id, top.logprob) for top in item.top],
        )
        for item in items
    ]
    return converted or None


def completion_from_proto(response: inference_pb2.GenerateResponse) -> Completion:
    """Convert a GenerateResponse."""
    return Completion(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=finish_reason_name(response.finish_reason) or "unknown",
        usage=usage_from_proto(response.usage),
        logprobs=logprobs_from_proto(response.logprobs),
    )


def chunk_from_proto(response: inference_pb2.GenerateStreamResponse) -> CompletionChunk:
    """Convert one GenerateStreamResponse."""
    return CompletionChunk(
        request_id=response.request_id,
        text=response.text,
        token_ids=list(response.token_ids),
        logprobs=logprobs_from_proto(response.logprobs),
        finish_reason=finish_reason_name(response.finish_reason),
        usage=usage_from_proto(response.usage) if response.HasField("usage") else None,
    )


def model_info_from_proto(info: inference_pb2.ModelInfo) -> ModelInfo:
    """Convert a wire ModelInfo."""
    return ModelInfo(
        name=info.name,
        context_length=info.context_length,
        dtype=info.dtype,
        attention_backend=info.attention_backend,
        block_size=info.block_size,
        kv_cache_blocks=info.kv_cache_blocks,
        kv_cache_tokens=info.kv_cache_tokens,
        vocab_size=info.vocab_size,
        num_workers=info.num_workers,
        kv_cache_dtype=info.kv_cache_dtype,
    )

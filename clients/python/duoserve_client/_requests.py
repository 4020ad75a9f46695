"""Building wire requests from keyword arguments, validated at the edge.

Only types and the wire format's own limits (unsigned fields) are checked here; the
server checks value ranges and names the field, so the two never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TypedDict

from duoserve_client._proto import inference_pb2
from duoserve_client.errors import InvalidArgumentError
from duoserve_client.results import Message

MessageLike = Message | tuple[str, str] | Mapping[str, str]
"""A chat message as callers may pass it: a Message, a (role, content) pair or a dict."""


class GenerateOptions(TypedDict, total=False):
    """Keyword options of generate / stream / chat; each maps to the GenerateRequest field of its name.

    Unset options take the server's defaults (see ``protos/inference.proto``).
    """

    model: str
    max_tokens: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    logprobs: int | None
    priority: str | None
    deadline_ms: int | None


PRIORITIES = {
    "interactive": inference_pb2.PRIORITY_INTERACTIVE,
    "standard": inference_pb2.PRIORITY_STANDARD,
    "batch": inference_pb2.PRIORITY_BATCH,
}
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def to_message(item: object, index: int = 0) -> Message:
    """Normalise one chat message; raises InvalidArgumentError naming ``messages[index]``."""
    if isinstance(item, Message):
        role, content = item.role, item.content
    elif isinstance(item, tuple) and len(item) == 2:
        role, content = item
    elif isinstance(item, Mapping):
        missing = [key for key in ("role", "content") if key not in item]
        if missing:
            raise InvalidArgumentError(f"messages[{index}]: missing key(s) {', '.join(missing)}")
        role, content = item["role"], item["content"]
    else:
        raise InvalidArgumentError(
            f"messages[{index}]: expected Message, (role, content) or a dict with role and content, "
            f"got {type(item).__name__}"
        )
    if not isinstance(role, str) or not isinstance(content, str):
        raise InvalidArgumentError(f"messages[{index}]: role and content must be str")
    return Message(role=role, content=content)


def to_messages(messages: Sequence[MessageLike]) -> list[Message]:
    """Normalise a chat conversation; it must hold at least one message."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidArgumentError("messages: expected a sequence of messages")
    if not messages:
        raise InvalidArgumentError("messages: at least one message is required")
    return [to_message(item, index) for index, item in enumerate(messages)]


def _messages_to_proto(messages: Sequence[Message]) -> list[inference_pb2.ChatMessage]:
    return [inference_pb2.ChatMessage(role=m.role, content=m.content) for m in messages]


def _check_uint(name: str, value: object, limit: int = _UINT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise InvalidArgumentError(f"{name}: must be in [0, {limit}], got {value}")
    return value


def _check_uints(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidArgumentError(f"{name}: expected a sequence of ints")
    return [_check_uint(f"{name}[{i}]", value) for i, value in enumerate(values)]


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _check_stop(stop: str | Sequence[str]) -> list[str]:
    strings = [stop] if isinstance(stop, str) else list(stop)
    for i, item in enumerate(strings):
        if not isinstance(item, str) or not item:
            raise InvalidArgumentError(f"stop[{i}]: expected a non-empty str, got {item!r}")
    return strings


def build_generate_request(
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[MessageLike] | None = None,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    priority: str | None = None,
    deadline_ms: int | None = None,
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest; exactly one of prompt, prompt_token_ids and messages must be given."""
    sources = (("prompt", prompt), ("prompt_token_ids", prompt_token_ids), ("messages", messages))
    given = [name for name, value in sources if value is not None]
    if len(given) != 1:
        raise InvalidArgumentError(
            "exactly one of prompt, prompt_token_ids and messages must be given, "
            f"got {', '.join(given) if given else 'none'}"
        )
    request = inference_pb2.GenerateRequest(model=model, ignore_eos=bool(ignore_eos))
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidArgumentError("prompt: expected a non-empty str")
        request.prompt = prompt
    elif prompt_token_ids is not None:
        ids = _check_uints("prompt_token_ids", prompt_token_ids)
        if not ids:
            raise InvalidArgumentError("prompt_token_ids: at least one token id is required")
        request.prompt_token_ids.extend(ids)
    elif messages is not None:
        request.messages.extend(_messages_to_proto(to_messages(messages)))

    if priority is not None:
        if priority not in PRIORITIES:
            raise InvalidArgumentError(f"priority: {priority!r}; use one of {', '.join(PRIORITIES)}")
        request.priority = PRIORITIES[priority]
    numbers = (
        ("max_tokens", max_tokens),
        ("top_k", top_k),
        ("logprobs", logprobs),
        ("deadline_ms", deadline_ms),
    )
    for name, value in numbers:
        if value is not None:
            setattr(request, name, _check_uint(name, value))
    if seed is not None:
        request.seed = _check_uint("seed", seed, _UINT64_MAX)
    floats = (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("repetition_penalty", repetition_penalty),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    )
    for name, number in floats:
        if number is not None:
            setattr(request, name, _check_float(name, number))
    if stop is not None:
        request.stop.extend(_check_stop(stop))
    if stop_token_ids is not None:
        request.stop_token_ids.extend(_check_uints("stop_token_ids", stop_token_ids))
    return request


def build_tokenize_request(
    text_or_messages: str | Sequence[MessageLike], *, model: str, add_special_tokens: bool
) -> inference_pb2.TokenizeRequest:
    """A TokenizeRequest for a text, or for chat messages rendered with the chat template."""
    request = inference_pb2.TokenizeRequest(model=model, add_special_tokens=bool(add_special_tokens))
    if isinstance(text_or_messages, str):
        if not text_or_messages:
            raise InvalidArgumentError("text: expected a non-empty str")
        request.text = text_or_messages
    else:
        request.messages.extend(_messages_to_proto(to_messages(text_or_messages)))
    return request

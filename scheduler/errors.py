"""Maps failures to gRPC status codes, in one place.

Bad input -> INVALID_ARGUMENT naming the field; overload -> RESOURCE_EXHAUSTED;
not ready or worker lost -> UNAVAILABLE. Anything unexpected is logged with its
traceback and answered INTERNAL with a short message, never UNKNOWN.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from scheduler.validation import InvalidRequest

log = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not parse (see `safe_deserializer`)."""

    type_name: str
    error: str


def safe_deserializer(parse: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """A request deserializer that never raises: gRPC would answer UNKNOWN to a parse error."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            return MalformedRequest(type_name, str(err))

    return deserialize


def _reject_malformed(request: object) -> None:
    if isinstance(request, MalformedRequest):
        raise InvalidRequest("request", f"the bytes are not a valid {request.type_name} ({request.error})")


class RpcFailure(Exception):
    """Ends an RPC with a status code and message (raised inside servicer methods)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_code_of(err: BaseException) -> grpc.StatusCode:
    """The status code an exception ends its RPC with (CANCELLED for cancellation)."""
    if isinstance(err, RpcFailure):
        return err.code
    if isinstance(err, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if not isinstance(err, Exception):  # asyncio.CancelledError, GeneratorExit: the call went away
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def _status_of(err: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(err, RpcFailure):
        return err.code, err.message
    if isinstance(err, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    log.exception("internal error while serving a request")
    return grpc.StatusCode.INTERNAL, f"internal error ({type(err).__name__}); see the server log"


def _is_abort(err: BaseException) -> bool:
    # context.abort() raises this to end the RPC; it must pass through untouched.
    return type(err).__name__ == "AbortError"


def unary_errors(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            _reject_malformed(request)
            return await method(self, request, context)
        except Exception as err:
            if _is_abort(err):
                raise
            code, message = _status_of(err)
            await context.abort(code, message)
            raise AssertionError("context.abort returned") from err

    return wrapper


def stream_errors(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            _reject_malformed(request)
            async for item in method(self, request, context):
                yield item
        except Exception as err:
            if _is_abort(err):
                raise
            code, message = _status_of(err)
            await context.abort(code, message)

    return wrapper

"""Typed exceptions for gRPC failures, one class per status code the server uses."""

from __future__ import annotations

import grpc


class DuoserveError(Exception):
    """A failed call: the gRPC status ``code`` and the server's ``details`` message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        if code is not None:
            self.code = code
        self.details = details
        super().__init__(f"{self.code.name}: {details}")

    @property
    def exit_status(self) -> int:
        """The gRPC status number (3 for INVALID_ARGUMENT, 14 for UNAVAILABLE, ...), for CLIs."""
        number: int = self.code.value[0]
        return number


class RpcCancelledError(DuoserveError):
    """CANCELLED; named so that it does not shadow ``asyncio.CancelledError``."""

    code = grpc.StatusCode.CANCELLED


class InvalidArgumentError(DuoserveError, ValueError):
    """INVALID_ARGUMENT: a request field is wrong; the details name the field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(DuoserveError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(DuoserveError):
    """NOT_FOUND: e.g. an unknown model or health service name."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDeniedError(DuoserveError):
    """PERMISSION_DENIED."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(DuoserveError):
    """RESOURCE_EXHAUSTED: the server is overloaded; back off before sending more."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(DuoserveError):
    """FAILED_PRECONDITION."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(DuoserveError):
    """ABORTED: the server gave up on the request (e.g. its worker was lost)."""

    code = grpc.StatusCode.ABORTED


class UnimplementedError(DuoserveError):
    """UNIMPLEMENTED: the server does not offer this RPC."""

    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(DuoserveError):
    """INTERNAL."""

    code = grpc.StatusCode.INTERNAL


class UnavailableError(DuoserveError):
    """UNAVAILABLE: not reachable, not ready, or lost its worker; safe to retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(DuoserveError):
    """UNAUTHENTICATED."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[DuoserveError]] = {
    cls.code: cls
    for cls in (
        RpcCancelledError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        UnauthenticatedError,
    )
}


def error_for_status(code: grpc.StatusCode, details: str) -> DuoserveError:
    """The typed exception for a status code; codes without a class give a plain DuoserveError."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return DuoserveError(details, code)
    return cls(details)


def error_from_rpc(error: grpc.RpcError) -> DuoserveError:
    """Convert a ``grpc.RpcError`` (sync or ``grpc.aio``) into its typed exception."""
    code_fn = getattr(error, "code", None)
    details_fn = getattr(error, "details", None)
    code = code_fn() if callable(code_fn) else None
    details = details_fn() if callable(details_fn) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return error_for_status(code, details if isinstance(details, str) else str(error))

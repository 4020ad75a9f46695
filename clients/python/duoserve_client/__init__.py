"""duoserve client SDK: sync and asyncio clients, typed results and errors, a CLI.

from duoserve_client import Client

with Client("localhost:50051") as client:
    print(client.generate("Hello", max_tokens=16).text)
"""

from duoserve_client._requests import GenerateOptions, MessageLike
from duoserve_client._security import tls_credentials
from duoserve_client.aio import AsyncClient
from duoserve_client.client import Client
from duoserve_client.errors import (
    AbortedError,
    DeadlineExceededError,
    DuoserveError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    RpcCancelledError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    error_for_status,
    error_from_rpc,
)
from duoserve_client.results import Completion, CompletionChunk, Message, ModelInfo, TokenLogprob, Usage

__all__ = [
    "AbortedError",
    "AsyncClient",
    "Client",
    "Completion",
    "CompletionChunk",
    "DeadlineExceededError",
    "DuoserveError",
    "FailedPreconditionError",
    "GenerateOptions",
    "InternalError",
    "InvalidArgumentError",
    "Message",
    "MessageLike",
    "ModelInfo",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "RpcCancelledError",
    "TokenLogprob",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "error_for_status",
    "error_from_rpc",
    "tls_credentials",
]

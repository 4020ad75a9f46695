"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import grpc

from duoserve_client._channel import DEFAULT_TARGET, NOT_YET_READY, ClientSettings
from duoserve_client._health import CHECK_METHOD, health_messages, status_name
from duoserve_client._proto import inference_pb2, inference_pb2_grpc
from duoserve_client._requests import MessageLike, build_generate_request, build_tokenize_request
from duoserve_client._retry import Deadline
from duoserve_client._security import api_key_metadata
from duoserve_client._tracing import with_trace_context
from duoserve_client.errors import DeadlineExceededError, error_for_status, error_from_rpc
from duoserve_client.results import (
    Completion,
    CompletionChunk,
    ModelInfo,
    chunk_from_proto,
    completion_from_proto,
    model_info_from_proto,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from duoserve_client._requests import GenerateOptions

T = TypeVar("T")


class Client:
    """Blocking client of a duoserve server; use as a context manager or call ``close()``.

    ``timeout`` is the default per-call deadline in seconds (None: no deadline); a call's
    own ``timeout`` replaces it and covers every retry of that call. Calls that failed
    with UNAVAILABLE before any output are retried up to ``retries`` times.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        retries: int = 3,
        backoff_initial: float = 0.1,
        backoff_max: float = 2.0,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        metadata: Sequence[tuple[str, str]] = (),
        api_key: str | None = None,
    ) -> None:
        self._settings = ClientSettings.build(
            target,
            timeout=timeout,
            retries=retries,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            options=options,
            metadata=(*metadata, *api_key_metadata(api_key)),
        )
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=self._settings.options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=self._settings.options)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        messages = health_messages()
        self._health_check = self._channel.unary_unary(
            CHECK_METHOD,
            request_serializer=messages.request.SerializeToString,
            response_deserializer=messages.response.FromString,
        )

    @property
    def target(self) -> str:
        """The server address this client talks to."""
        return self._settings.target

    def close(self) -> None:
        """Close the channel; calls in progress are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- completions ---------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """Complete a prompt (text or token ids) and return the whole completion."""
        request = build_generate_request(prompt=prompt, prompt_token_ids=prompt_token_ids, **options)
        return completion_from_proto(self._unary(self._stub.Generate, request, timeout))

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Generator[CompletionChunk, None, None]:
        """Complete a prompt, yielding chunks as they arrive.

        Closing the generator (or dropping it after ``break``) cancels the RPC, so the
        server frees the request.
        """
        request = build_generate_request(prompt=prompt, prompt_token_ids=prompt_token_ids, **options)
        return self._stream(request, timeout)

    @overload
    def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        stream: Literal[False] = False,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion: ...

    @overload
    def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        stream: Literal[True],
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Generator[CompletionChunk, None, None]: ...

    def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        stream: bool = False,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion | Generator[CompletionChunk, None, None]:
        """Answer a conversation rendered with the model's chat template; ``stream=True`` yields chunks.

        Messages may be ``Message`` objects, ``(role, content)`` pairs or dicts.
        """
        request = build_generate_request(messages=messages, **options)
        if stream:
            return self._stream(request, timeout)
        return completion_from_proto(self._unary(self._stub.Generate, request, timeout))

    # -- other RPCs ----------------------------------------------------------------------

    def tokenize(
        self,
        text_or_messages: str | Sequence[MessageLike],
        *,
        model: str = "",
        add_special_tokens: bool = False,
        timeout: float | None = None,
    ) -> list[int]:
        """Token ids of a text, or of chat messages rendered with the chat template."""
        request = build_tokenize_request(text_or_messages, model=model, add_special_tokens=add_special_tokens)
        response = self._unary(self._stub.Tokenize, request, timeout)
        return list(response.token_ids)

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the server serves, with their serving configuration."""
        response = self._unary(self._stub.ListModels, inference_pb2.ListModelsRequest(), timeout)
        return [model_info_from_proto(info) for info in response.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server): "SERVING", ..."""
        request = health_messages().request(service=service)
        return status_name(self._unary(self._health_check, request, timeout))

    def wait_until_ready(self, timeout: float = 60.0, *, service: str = "", interval: float = 0.25) -> None:
        """Poll health until SERVING; raises DeadlineExceededError after ``timeout`` seconds."""
        deadline = Deadline.after(timeout)
        request = health_messages().request(service=service)
        last = "no answer"
        while True:
            remaining = deadline.remaining()
            assert remaining is not None, "wait_until_ready always has a deadline"
            try:
                response = self._health_check(
                    request, timeout=max(0.01, min(remaining, 5.0)), metadata=self._settings.metadata
                )
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                if error.code not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.NOT_FOUND,
                ):
                    raise error from err
                last = f"{error.code.name}: {error.details}"
            else:
                status = status_name(response)
                if status not in NOT_YET_READY:
                    return
                last = status
            if not deadline.allows(interval):
                raise DeadlineExceededError(f"{self.target} not SERVING after {timeout:g} s (last: {last})")
            time.sleep(interval)

    # -- call machinery ------------------------------------------------------------------

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        """One unary call with the deadline and the retry policy applied."""
        deadline = Deadline.after(self._settings.call_timeout(timeout))
        attempt = 0
        while True:
            try:
                return method(
                    request,
                    timeout=deadline.remaining(),
                    metadata=with_trace_context(self._settings.metadata),
                )
            except grpc.RpcError as err:
                delay = self._settings.retry.delay(attempt, err.code())
                if delay is None or not deadline.allows(delay):
                    raise error_from_rpc(err) from err
            time.sleep(delay)
            attempt += 1

    def _stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None
    ) -> Generator[CompletionChunk, None, None]:
        deadline = Deadline.after(self._settings.call_timeout(timeout))
        attempt = 0
        while True:
            remaining = deadline.remaining()
            if remaining == 0.0:
                raise error_for_status(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while retrying")
            call = self._stub.GenerateStream(
                request, timeout=remaining, metadata=with_trace_context(self._settings.metadata)
            )
            received = False
            try:
                for response in call:
                    received = True
                    yield chunk_from_proto(response)
                return
            except grpc.RpcError as err:
                # Once a chunk reached the caller a retry would repeat output: never retry then.
                delay = None if received else self._settings.retry.delay(attempt, err.code())
                if delay is None or not deadline.allows(delay):
                    raise error_from_rpc(err) from err
            finally:
                # A no-op for a finished call; for a caller that stopped early it frees the
                # request on the server.
                call.cancel()
            time.sleep(delay)
            attempt += 1

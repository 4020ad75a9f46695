"""The asyncio client (``grpc.aio``); the same calls as ``Client``, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import grpc
import grpc.aio

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


class AsyncClient:
    """asyncio client of a duoserve server; use ``async with`` or ``await close()``.

    Create it inside the event loop that will use it. Deadlines and retries behave as in
    ``Client``.
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
            self._channel = grpc.aio.insecure_channel(target, options=self._settings.options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=self._settings.options)
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

    async def close(self) -> None:
        """Close the channel; calls in progress are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- completions ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """Complete a prompt (text or token ids) and return the whole completion."""
        request = build_generate_request(prompt=prompt, prompt_token_ids=prompt_token_ids, **options)
        return await self._complete(request, timeout)

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerator[CompletionChunk, None]:
        """Complete a prompt; ``async for`` over the chunks as they arrive.

        ``aclose()`` cancels the RPC at once; after a bare ``break`` asyncio closes the
        generator (and so cancels the RPC) when it is garbage-collected.
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
    ) -> Coroutine[Any, Any, Completion]: ...

    @overload
    def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        stream: Literal[True],
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGenerator[CompletionChunk, None]: ...

    def chat(
        self,
        messages: Sequence[MessageLike],
        *,
        stream: bool = False,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Coroutine[Any, Any, Completion] | AsyncGenerator[CompletionChunk, None]:
        """Answer a conversation rendered with the model's chat template.

        ``await client.chat(messages)`` gives a Completion; ``async for chunk in
        client.chat(messages, stream=True)`` streams. Messages may be ``Message`` objects,
        ``(role, content)`` pairs or dicts.
        """
        request = build_generate_request(messages=messages, **options)
        if stream:
            return self._stream(request, timeout)
        return self._complete(request, timeout)

    # -- other RPCs ----------------------------------------------------------------------

    async def tokenize(
        self,
        text_or_messages: str | Sequence[MessageLike],
        *,
        model: str = "",
        add_special_tokens: bool = False,
        timeout: float | None = None,
    ) -> list[int]:
        """Token ids of a text, or of chat messages rendered with the chat template."""
        request = build_tokenize_request(text_or_messages, model=model, add_special_tokens=add_special_tokens)
        response = await self._unary(self._stub.Tokenize, request, timeout)
        return list(response.token_ids)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The models the server serves, with their serving configuration."""
        response = await self._unary(self._stub.ListModels, inference_pb2.ListModelsRequest(), timeout)
        return [model_info_from_proto(info) for info in response.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server): "SERVING", ..."""
        request = health_messages().request(service=service)
        return status_name(await self._unary(self._health_check, request, timeout))

    async def wait_until_ready(
        self, timeout: float = 60.0, *, service: str = "", interval: float = 0.25
    ) -> None:
        """Poll health until SERVING; raises DeadlineExceededError after ``timeout`` seconds."""
        deadline = Deadline.after(timeout)
        request = health_messages().request(service=service)
        last = "no answer"
        while True:
            remaining = deadline.remaining()
            assert remaining is not None, "wait_until_ready always has a deadline"
            try:
                response = await self._health_check(
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
            await asyncio.sleep(interval)

    # -- call machinery ------------------------------------------------------------------

    async def _complete(self, request: inference_pb2.GenerateRequest, timeout: float | None) -> Completion:
        return completion_from_proto(await self._unary(self._stub.Generate, request, timeout))

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any, timeout: float | None) -> T:
        """One unary call with the deadline and the retry policy applied."""
        deadline = Deadline.after(self._settings.call_timeout(timeout))
        attempt = 0
        while True:
            try:
                return await method(
                    request,
                    timeout=deadline.remaining(),
                    metadata=with_trace_context(self._settings.metadata),
                )
            except grpc.RpcError as err:
                delay = self._settings.retry.delay(attempt, err.code())
                if delay is None or not deadline.allows(delay):
                    raise error_from_rpc(err) from err
            await asyncio.sleep(delay)
            attempt += 1

    async def _stream(
        self, request: inference_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[CompletionChunk, None]:
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
                async for response in call:
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
            await asyncio.sleep(delay)
            attempt += 1

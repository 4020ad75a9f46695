"""The duoserve.v1.Inference gRPC service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from protos import inference_pb2, inference_pb2_grpc
from scheduler import tracing
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.engine import Admission, Engine
from scheduler.errors import RpcFailure, status_code_of, stream_errors, unary_errors
from scheduler.metrics import RequestMetrics
from scheduler.request import OutputEvent, Request, RequestState
from scheduler.tokenizer import Tokenizer
from scheduler.validation import InvalidRequest, ModelLimits, check_model, render_messages, validate_generate

log = logging.getLogger(__name__)

# Prompt tokens the detokenizer sees before the first output token, so that
# token decodes with the right leading space.
DETOKENIZER_CONTEXT = 4

_ADMISSION_ERRORS = {
    Admission.NOT_READY: (grpc.StatusCode.UNAVAILABLE, "the server is starting: the worker is not ready yet"),
    Admission.SHUTTING_DOWN: (grpc.StatusCode.UNAVAILABLE, "the server is shutting down"),
    Admission.QUEUE_FULL_REQUESTS: (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the request queue is full: --max-queued-requests requests are waiting or running; retry later",
    ),
    Admission.QUEUE_FULL_TOKENS: (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the request queue is full: this prompt would take the queued prompt tokens past "
        "--max-queued-tokens; retry later",
    ),
}


@dataclass(slots=True)
class _Call:
    span: Span | None = None
    request: Request | None = None


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(
        self, engine: Engine, tokenizer: Tokenizer, model_name: str, metrics: RequestMetrics | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics

    # ------------------------------------------------------------------ helpers

    def _limits(self) -> ModelLimits:
        info = self.engine.worker_info
        if info is None or not self.engine.ready:
            raise RpcFailure(
                grpc.StatusCode.UNAVAILABLE, "the server is starting: the worker is not ready yet"
            )
        return ModelLimits(
            name=self.model_name,
            context_length=info.context_length,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.num_blocks * info.block_size,
        )

    @contextlib.contextmanager
    def _call(self, context: grpc.aio.ServicerContext, method: str) -> Iterator[_Call]:
        """One Generate/GenerateStream call: its root span (continuing the caller's traceparent,
        when tracing is on) and, when it ends, the request metrics with its status code."""
        call = _Call()
        if tracing.enabled():
            call.span = tracing.tracer().start_span(
                f"duoserve.v1.Inference/{method}",
                context=tracing.extract(context.invocation_metadata() or ()),
                kind=SpanKind.SERVER,
                attributes={
                    "rpc.system": "grpc",
                    "rpc.service": "duoserve.v1.Inference",
                    "rpc.method": method,
                },
            )
        code = "OK"
        try:
            yield call
        except BaseException as err:
            status = status_code_of(err)
            code = status.name
            if call.span is not None:
                call.span.set_attribute("rpc.grpc.status_code", status.value[0])
                call.span.set_status(Status(StatusCode.ERROR, f"{code}: {err}"))
            raise
        finally:
            if self.metrics is not None:
                if call.request is not None:
                    self.metrics.record(call.request, code)
                else:  # refused before it was admitted: invalid, overloaded, not ready
                    self.metrics.requests.labels(finish_reason="none", code=code).inc()
            if call.span is not None:
                call.span.end()

    def _admit(
        self, message: inference_pb2.GenerateRequest, call: _Call | None = None, streamed: bool = True
    ) -> Request:
        limits = self._limits()
        ids, params = validate_generate(
            message, self.tokenizer, limits, self.engine.config.default_max_tokens
        )
        request = Request(
            request_id=uuid.uuid4().hex,
            seq_id=self.engine.new_seq_id(),
            prompt_token_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, stop=params.stop, prefix_token_ids=ids[-DETOKENIZER_CONTEXT:]
            ),
            events=asyncio.Queue(),
            streamed=streamed,
        )
        if call is not None and call.span is not None and call.span.is_recording():
            request.trace = tracing.RequestTrace(call.span, self.model_name)
        admission = self.engine.submit(request)
        if admission is not Admission.ADMITTED:
            raise RpcFailure(*_ADMISSION_ERRORS[admission])
        if call is not None:
            call.request = request
        return request

    async def _events(self, request: Request) -> AsyncIterator[OutputEvent]:
        """The request's events until its last; aborts the request if the caller goes away."""
        try:
            while True:
                event = await request.events.get()
                if event.error is not None:
                    code, message = event.error
                    raise RpcFailure(grpc.StatusCode[code], message)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if request.state is not RequestState.FINISHED:
                self.engine.abort(request)

    def _usage(self, request: Request) -> inference_pb2.Usage:
        return inference_pb2.Usage(
            prompt_tokens=request.prompt_len,
            completion_tokens=len(request.output_token_ids),
            cached_prompt_tokens=request.num_cached_prompt_tokens,
        )

    # ------------------------------------------------------------------ RPCs

    @unary_errors
    async def Generate(
        self, message: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        with self._call(context, "Generate") as call:
            request = self._admit(message, call, streamed=False)
            response = inference_pb2.GenerateResponse(request_id=request.request_id)
            texts = []
            async for event in self._events(request):
                texts.append(event.text)
                response.token_ids.extend(event.token_ids)
                response.logprobs.extend(event.logprobs)
                if event.finish_reason is not None:
                    response.finish_reason = event.finish_reason.value
            response.text = "".join(texts)
            response.usage.CopyFrom(self._usage(request))
            return response

    @stream_errors
    async def GenerateStream(
        self, message: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        with self._call(context, "GenerateStream") as call:
            request = self._admit(message, call)
            async for event in self._events(request):
                chunk = inference_pb2.GenerateStreamResponse(
                    request_id=request.request_id,
                    text=event.text,
                    token_ids=event.token_ids,
                    logprobs=event.logprobs,
                )
                if event.finish_reason is not None:
                    chunk.finish_reason = event.finish_reason.value
                    chunk.usage.CopyFrom(self._usage(request))
                yield chunk

    @unary_errors
    async def Tokenize(
        self, message: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        check_model(message.model, self._limits())
        if message.text and message.messages:
            raise InvalidRequest("messages", "set only one of text and messages")
        if message.messages:
            ids = self.tokenizer.encode(
                render_messages(message.messages, self.tokenizer), add_special_tokens=False
            )
        else:
            ids = self.tokenizer.encode(message.text, add_special_tokens=message.add_special_tokens)
        return inference_pb2.TokenizeResponse(token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids))

    @unary_errors
    async def ListModels(
        self, message: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        self._limits()
        info = self.engine.worker_info
        assert info is not None
        model = inference_pb2.ModelInfo(
            name=self.model_name,
            context_length=info.context_length,
            dtype=info.dtype,
            attention_backend=info.attention_backend,
            block_size=info.block_size,
            kv_cache_blocks=info.num_blocks,
            kv_cache_tokens=info.num_blocks * info.block_size,
            vocab_size=info.vocab_size,
            num_workers=self.engine.config.num_workers,
            kv_cache_dtype=info.kv_cache_dtype or info.dtype,
        )
        return inference_pb2.ListModelsResponse(models=[model])

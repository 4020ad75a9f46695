"""Fuzzing a live server (bounded): well-typed and malformed requests, and raw bytes on the wire.

The server must never crash, never answer UNKNOWN or INTERNAL (or UNAVAILABLE) to a client's
mistake, and must serve valid requests exactly as before afterwards.
"""

from __future__ import annotations

import contextlib
import math
import socket

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duoserve_client import Client
from duoserve_client._proto import inference_pb2
from tests.e2e.harness import PROMPTS, ServerProcess, chat

pytestmark = pytest.mark.slow

# A valid request may generate for a while: the call's short deadline bounds it.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, math.nan, math.inf, -math.inf, 1e30]),
)
uint32 = st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
text = st.text(max_size=200)


@st.composite
def generate_requests(draw: st.DrawFn) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest()
    source = draw(st.sampled_from(["prompt", "ids", "messages", "none", "two"]))
    if source in ("prompt", "two"):
        request.prompt = draw(text)
    if source in ("ids", "two"):
        request.prompt_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=40)))
    if source == "messages":
        for _ in range(draw(st.integers(0, 4))):
            request.messages.add(
                role=draw(st.sampled_from(["user", "system", "assistant", "", "robot"])), content=draw(text)
            )
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            setattr(request, name, draw(floats))
    for name in ("max_tokens", "top_k", "logprobs", "deadline_ms"):
        if draw(st.booleans()):
            setattr(request, name, draw(uint32))
    if draw(st.booleans()):
        request.seed = draw(st.integers(0, 2**64 - 1))
    request.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    request.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=70)))
    request.ignore_eos = draw(st.booleans())
    request.priority = draw(st.integers(0, 6))
    request.model = draw(st.sampled_from(["", "SmolLM2-135M-Instruct.Q4_1", "other"]))
    return request


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def test_random_requests_random_payloads_and_garbage_leave_the_server_correct(
    smollm_server: ServerProcess, reference: dict[str, tuple[str, list[int]]]
) -> None:
    channel = grpc.insecure_channel(smollm_server.target)
    generate = channel.unary_unary(
        "/duoserve.v1.Inference/Generate",
        request_serializer=inference_pb2.GenerateRequest.SerializeToString,
        response_deserializer=inference_pb2.GenerateResponse.FromString,
    )
    stream = channel.unary_stream(
        "/duoserve.v1.Inference/GenerateStream",
        request_serializer=inference_pb2.GenerateRequest.SerializeToString,
        response_deserializer=inference_pb2.GenerateStreamResponse.FromString,
    )
    raw_calls = [
        channel.unary_unary(
            f"/duoserve.v1.Inference/{name}", request_serializer=None, response_deserializer=None
        )
        for name in ("Generate", "Tokenize", "ListModels")
    ]
    seen: dict[str, set[grpc.StatusCode]] = {"typed": set(), "raw": set()}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(request=generate_requests(), streaming=st.booleans())
    def typed(request: inference_pb2.GenerateRequest, streaming: bool) -> None:
        if streaming:
            code = code_of(lambda: list(stream(request, timeout=1.0)))
        else:
            code = code_of(lambda: generate(request, timeout=1.0))
        seen["typed"].add(code)
        assert code in ALLOWED, (code, request)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=st.binary(max_size=300), which=st.integers(0, 2))
    def raw(payload: bytes, which: int) -> None:
        code = code_of(lambda: raw_calls[which](payload, timeout=1.0))
        seen["raw"].add(code)
        assert code in ALLOWED, (code, payload)

    typed()
    raw()
    channel.close()
    assert (
        grpc.StatusCode.INVALID_ARGUMENT in seen["typed"] and grpc.StatusCode.INVALID_ARGUMENT in seen["raw"]
    )

    # Bytes that are not HTTP/2 at all, straight at the gRPC port.
    host, port = smollm_server.target.rsplit(":", 1)
    for garbage in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 8):
        with socket.create_connection((host, int(port)), timeout=5) as raw_socket:
            raw_socket.sendall(garbage)
            raw_socket.settimeout(2)
            with contextlib.suppress(TimeoutError, ConnectionError):
                raw_socket.recv(1024)

    assert smollm_server.process.poll() is None, "the server died"
    with Client(smollm_server.target) as client:
        for prompt in PROMPTS[:3]:
            completion = chat(client, prompt)
            assert (completion.text, completion.token_ids) == reference[prompt]

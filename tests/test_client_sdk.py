"""Unit tests of the client SDK and CLI against a scripted in-process gRPC server.

The server here is a test double for the SDK's own logic (retries, deadlines, stream
cancellation, error mapping, conversions); it is not duoserve's server.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from duoserve_client import (
    AsyncClient,
    Client,
    Completion,
    DeadlineExceededError,
    DuoserveError,
    InvalidArgumentError,
    Message,
    ModelInfo,
    ResourceExhaustedError,
    RpcCancelledError,
    TokenLogprob,
    UnavailableError,
    Usage,
    error_for_status,
)
from duoserve_client._proto import inference_pb2, inference_pb2_grpc
from duoserve_client._retry import RetryPolicy
from duoserve_client.cli import main

PIECES = (("Hel", 10), ("lo", 11), (" world", 12))
MODEL = inference_pb2.ModelInfo(
    name="tiny",
    context_length=2048,
    dtype="float32",
    attention_backend="torch-cpu",
    block_size=16,
    kv_cache_blocks=100,
    kv_cache_tokens=1600,
    vocab_size=49152,
    num_workers=1,
)


@dataclass
class Script:
    """What the fake server does; reset before every test."""

    refusals: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)  # answered first, in order
    fail_stream_after: int | None = None  # abort a stream with UNAVAILABLE after this many chunks
    endless_stream: bool = False
    delay: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    requests: list[Any] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    stream_cancelled: threading.Event = field(default_factory=threading.Event)


class FakeInference(inference_pb2_grpc.InferenceServicer):
    """Answers 'Hello world' in three pieces, after any scripted refusals."""

    def __init__(self) -> None:
        self.script = Script()

    def _begin(self, name: str, request: object, context: grpc.ServicerContext) -> None:
        script = self.script
        script.calls[name] = script.calls.get(name, 0) + 1
        script.requests.append(request)
        script.time_remaining.append(context.time_remaining())
        if script.delay:
            time.sleep(script.delay)
        if script.refusals:
            code, details = script.refusals.pop(0)
            context.abort(code, details)

    @staticmethod
    def _logprobs(request: inference_pb2.GenerateRequest, token_id: int) -> list[inference_pb2.TokenLogprob]:
        if not request.HasField("logprobs"):
            return []
        top = [
            inference_pb2.TopLogprob(token_id=token_id, logprob=-0.5),
            inference_pb2.TopLogprob(token_id=1),
        ]
        return [inference_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=top)]

    def Generate(self, request, context):
        self._begin("Generate", request, context)
        logprobs = [lp for _, token in PIECES for lp in self._logprobs(request, token)]
        return inference_pb2.GenerateResponse(
            request_id="req-1",
            text="Hello world",
            token_ids=[token for _, token in PIECES],
            finish_reason=inference_pb2.FINISH_REASON_STOP,
            usage=inference_pb2.Usage(prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=1),
            logprobs=logprobs,
        )

    def GenerateStream(self, request, context):
        self._begin("GenerateStream", request, context)
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self.script.stream_cancelled.set())
        if self.script.endless_stream:
            while context.is_active():
                yield inference_pb2.GenerateStreamResponse(request_id="req-s", text="x", token_ids=[7])
                time.sleep(0.01)
            return
        for index, (text, token) in enumerate(PIECES):
            if index == self.script.fail_stream_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
            last = index == len(PIECES) - 1
            yield inference_pb2.GenerateStreamResponse(
                request_id="req-s",
                text=text,
                token_ids=[token],
                logprobs=self._logprobs(request, token),
                finish_reason=inference_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=inference_pb2.Usage(prompt_tokens=4, completion_tokens=3) if last else None,
            )
        finished.set()

    def Tokenize(self, request, context):
        self._begin("Tokenize", request, context)
        ids = [len(request.text)] if request.text else [len(request.messages)]
        return inference_pb2.TokenizeResponse(token_ids=ids, tokens=["?"])

    def ListModels(self, request, context):
        self._begin("ListModels", request, context)
        return inference_pb2.ListModelsResponse(models=[MODEL])


@dataclass
class FakeServer:
    target: str
    servicer: FakeInference
    health: health.HealthServicer


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    servicer = FakeInference()
    health_servicer = health.HealthServicer()
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield FakeServer(f"127.0.0.1:{port}", servicer, health_servicer)
    grpc_server.stop(grace=None)


@pytest.fixture
def fake(server: FakeServer) -> FakeServer:
    server.servicer.script = Script()
    server.health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server


def dead_target() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def fast_client(target: str, **kwargs: object) -> Client:
    return Client(target, backoff_initial=0.01, backoff_max=0.02, **kwargs)  # type: ignore[arg-type]


# -- conversions and request building --------------------------------------------------------


def test_generate_returns_typed_completion(fake: FakeServer) -> None:
    with fast_client(fake.target) as client:
        completion = client.generate("hi", max_tokens=3, logprobs=2)
    assert completion == Completion(
        request_id="req-1",
        text="Hello world",
        token_ids=[10, 11, 12],
        finish_reason="stop",
        usage=Usage(prompt_tokens=4, completion_tokens=3, cached_prompt_tokens=1),
        logprobs=[TokenLogprob(token, -0.5, [(token, -0.5), (1, 0.0)]) for token in (10, 11, 12)],
    )


def test_generate_sends_every_option_and_leaves_unset_ones_unset(fake: FakeServer) -> None:
    with fast_client(fake.target) as client:
        client.generate(
            prompt_token_ids=[5, 6],
            model="tiny",
            max_tokens=7,
            temperature=0.5,
            top_k=3,
            top_p=0.75,
            min_p=0.25,
            repetition_penalty=1.5,
            presence_penalty=-1.0,
            frequency_penalty=2.0,
            seed=2**40,
            stop="END",
            stop_token_ids=[2],
            ignore_eos=True,
            logprobs=1,
        )
        client.generate("plain")
    full, plain = fake.servicer.script.requests
    assert full == inference_pb2.GenerateRequest(
        model="tiny",
        prompt_token_ids=[5, 6],
        max_tokens=7,
        temperature=0.5,
        top_k=3,
        top_p=0.75,
        min_p=0.25,
        repetition_penalty=1.5,
        presence_penalty=-1.0,
        frequency_penalty=2.0,
        seed=2**40,
        stop=["END"],
        stop_token_ids=[2],
        ignore_eos=True,
        logprobs=1,
    )
    assert plain == inference_pb2.GenerateRequest(prompt="plain")
    assert not plain.HasField("temperature") and not plain.HasField("max_tokens")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of prompt, prompt_token_ids and messages must be given, got none"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "got prompt, prompt_token_ids"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens: must be in [0, 4294967295], got -1"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]: must be in"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature: expected a finite number"),
        ({"prompt": "a", "stop": ["ok", ""]}, "stop[1]: expected a non-empty str"),
    ],
)
def test_bad_arguments_raise_before_any_call(fake: FakeServer, kwargs: dict, message: str) -> None:
    with fast_client(fake.target) as client, pytest.raises(InvalidArgumentError) as info:
        client.generate(**kwargs)
    assert message in info.value.details
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.servicer.script.calls == {}


def test_chat_converts_every_message_form(fake: FakeServer) -> None:
    with fast_client(fake.target) as client:
        completion = client.chat(
            [Message("system", "be brief"), ("user", "hi"), {"role": "assistant", "content": "yo"}],
            max_tokens=4,
        )
    assert completion.text == "Hello world"
    (request,) = fake.servicer.script.requests
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "yo"),
    ]
    assert request.prompt == "" and list(request.prompt_token_ids) == [] and request.max_tokens == 4


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([("user", "hi"), {"role": "user"}], "messages[1]: missing key(s) content"),
        (
            [("user", "hi"), ("user", "x", "y")],
            "messages[1]: expected Message, (role, content) or a dict with role and content, got tuple",
        ),
        ([("user", 3)], "messages[0]: role and content must be str"),
        ([], "messages: at least one message is required"),
    ],
)
def test_chat_rejects_malformed_messages(fake: FakeServer, messages: list, message: str) -> None:
    with fast_client(fake.target) as client, pytest.raises(InvalidArgumentError) as info:
        client.chat(messages)
    assert info.value.details == message
    assert fake.servicer.script.calls == {}


def test_stream_yields_chunks_with_finish_on_the_last(fake: FakeServer) -> None:
    with fast_client(fake.target) as client:
        chunks = list(client.stream("hi"))
    assert [(c.text, c.token_ids) for c in chunks] == [("Hel", [10]), ("lo", [11]), (" world", [12])]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert [c.usage for c in chunks] == [None, None, Usage(4, 3, 0)]
    assert all(c.logprobs is None for c in chunks)


def test_tokenize_list_models_and_health(fake: FakeServer) -> None:
    with fast_client(fake.target) as client:
        assert client.tokenize("abcd") == [4]
        assert client.tokenize([("user", "a"), ("user", "b")]) == [2]
        assert client.list_models() == [
            ModelInfo("tiny", 2048, "float32", "torch-cpu", 16, 100, 1600, 49152, 1)
        ]
        assert client.health() == "SERVING"
        fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert client.health() == "NOT_SERVING"


# -- errors, retries and deadlines ------------------------------------------------------------


def test_error_mapping_keeps_code_and_details() -> None:
    error = error_for_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (64 requests)")
    assert isinstance(error, ResourceExhaustedError)
    assert (error.code, error.details, error.exit_status) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "queue full (64 requests)",
        8,
    )
    assert type(error_for_status(grpc.StatusCode.CANCELLED, "x")) is RpcCancelledError
    other = error_for_status(grpc.StatusCode.DATA_LOSS, "bits")
    assert type(other) is DuoserveError and other.code == grpc.StatusCode.DATA_LOSS
    assert str(other) == "DATA_LOSS: bits"


def test_retry_policy_backs_off_exponentially_with_jitter() -> None:
    policy = RetryPolicy(retries=6, backoff_initial=0.1, backoff_max=1.0, rng=random.Random(0))
    unavailable = grpc.StatusCode.UNAVAILABLE
    for attempt, ceiling in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        delay = policy.delay(attempt, unavailable)
        assert delay is not None and ceiling * 0.5 <= delay < ceiling
    assert policy.delay(6, unavailable) is None
    for code in (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ):
        assert policy.delay(0, code) is None


@pytest.mark.parametrize("method", ["Generate", "Tokenize", "ListModels"])
def test_unary_calls_retry_unavailable_then_succeed(fake: FakeServer, method: str) -> None:
    fake.servicer.script.refusals = [(grpc.StatusCode.UNAVAILABLE, "warming up")] * 2
    with fast_client(fake.target, retries=2) as client:
        if method == "Generate":
            assert client.generate("hi").text == "Hello world"
        elif method == "Tokenize":
            assert client.tokenize("abc") == [3]
        else:
            assert client.list_models()[0].name == "tiny"
    assert fake.servicer.script.calls == {method: 3}


def test_retries_give_up_with_the_last_error(fake: FakeServer) -> None:
    fake.servicer.script.refusals = [(grpc.StatusCode.UNAVAILABLE, f"down {i}") for i in range(3)]
    with fast_client(fake.target, retries=1) as client, pytest.raises(UnavailableError) as info:
        client.generate("hi")
    assert (info.value.code, info.value.details) == (grpc.StatusCode.UNAVAILABLE, "down 1")
    assert fake.servicer.script.calls == {"Generate": 2}


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
    ],
)
def test_non_retryable_errors_are_raised_at_once(fake: FakeServer, code, error_type) -> None:
    fake.servicer.script.refusals = [(code, "max_tokens: must be <= 2048, got 5000")]
    with fast_client(fake.target, retries=5) as client, pytest.raises(error_type) as info:
        list(client.stream("hi"))
    assert (info.value.code, info.value.details) == (code, "max_tokens: must be <= 2048, got 5000")
    assert fake.servicer.script.calls == {"GenerateStream": 1}


def test_stream_refused_before_output_is_retried(fake: FakeServer) -> None:
    fake.servicer.script.refusals = [(grpc.StatusCode.UNAVAILABLE, "not ready")]
    with fast_client(fake.target) as client:
        assert "".join(c.text for c in client.stream("hi")) == "Hello world"
    assert fake.servicer.script.calls == {"GenerateStream": 2}


def test_stream_that_produced_output_is_never_retried(fake: FakeServer) -> None:
    fake.servicer.script.fail_stream_after = 1
    received = []
    with fast_client(fake.target, retries=5) as client, pytest.raises(UnavailableError, match="worker lost"):
        for chunk in client.stream("hi"):
            received.append(chunk.text)
    assert received == ["Hel"]
    assert fake.servicer.script.calls == {"GenerateStream": 1}


def test_timeouts_become_grpc_deadlines(fake: FakeServer) -> None:
    with fast_client(fake.target, timeout=7.0) as client:
        client.generate("a")
        client.generate("b", timeout=3.0)
        list(client.stream("c", timeout=2.0))
    with fast_client(fake.target) as client:
        client.tokenize("d")
    # The wire carries the deadline as a rounded timeout, so allow a little slack above.
    default, own, stream, none = fake.servicer.script.time_remaining
    assert default is not None and 6.0 < default < 7.05
    assert own is not None and 2.0 < own < 3.05
    assert stream is not None and 1.0 < stream < 2.05
    assert none is None or none > 1e6  # no deadline


def test_deadline_exceeded_is_typed_and_not_retried(fake: FakeServer) -> None:
    fake.servicer.script.delay = 0.6
    start = time.monotonic()
    with fast_client(fake.target, retries=5) as client, pytest.raises(DeadlineExceededError) as info:
        client.generate("slow", timeout=0.2)
    assert time.monotonic() - start < 0.55
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and isinstance(info.value, TimeoutError)
    time.sleep(0.5)  # let the servicer thread finish before the next test resets the script
    assert fake.servicer.script.calls == {"Generate": 1}


def test_closing_a_stream_cancels_the_call_on_the_server(fake: FakeServer) -> None:
    fake.servicer.script.endless_stream = True
    with fast_client(fake.target) as client:
        chunks = client.stream("hi")
        assert [next(chunks).text, next(chunks).text] == ["x", "x"]
        chunks.close()
        assert fake.servicer.script.stream_cancelled.wait(5.0)
        # The channel is still usable afterwards.
        assert client.generate("again").text == "Hello world"


def test_breaking_out_of_a_stream_cancels_the_call(fake: FakeServer) -> None:
    fake.servicer.script.endless_stream = True
    with fast_client(fake.target) as client:
        for index, _ in enumerate(client.stream("hi")):
            if index == 2:
                break
        assert fake.servicer.script.stream_cancelled.wait(5.0)


def test_wait_until_ready_polls_until_serving(fake: FakeServer) -> None:
    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    timer = threading.Timer(0.3, fake.health.set, ("", health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    start = time.monotonic()
    with fast_client(fake.target) as client:
        client.wait_until_ready(5.0, interval=0.05)
    assert 0.25 < time.monotonic() - start < 3.0


def test_wait_until_ready_times_out_on_a_dead_port() -> None:
    start = time.monotonic()
    with (
        fast_client(dead_target()) as client,
        pytest.raises(DeadlineExceededError, match="not SERVING after"),
    ):
        client.wait_until_ready(0.5, interval=0.05)
    assert time.monotonic() - start < 2.0


# -- asyncio client ---------------------------------------------------------------------------


def test_async_client_generate_stream_chat_and_retry(fake: FakeServer) -> None:
    async def scenario() -> None:
        fake.servicer.script.refusals = [(grpc.StatusCode.UNAVAILABLE, "warming up")]
        async with AsyncClient(fake.target, backoff_initial=0.01, timeout=9.0) as client:
            assert (await client.generate("hi")).text == "Hello world"
            texts = [chunk.text async for chunk in client.stream(prompt_token_ids=[1, 2])]
            assert texts == ["Hel", "lo", " world"]
            assert (await client.chat([("user", "hi")])).finish_reason == "stop"
            chat_chunks = [c async for c in client.chat([("user", "hi")], stream=True)]
            assert chat_chunks[-1].finish_reason == "length"
            assert await client.tokenize("abc") == [3]
            assert (await client.list_models())[0].kv_cache_tokens == 1600
            assert await client.health() == "SERVING"
            await client.wait_until_ready(1.0)

    asyncio.run(scenario())
    script = fake.servicer.script
    assert script.calls == {"Generate": 3, "GenerateStream": 2, "Tokenize": 1, "ListModels": 1}
    assert len(script.time_remaining) == 7
    assert all(remaining is not None and 8.0 < remaining < 9.05 for remaining in script.time_remaining), (
        script.time_remaining
    )


def test_async_errors_are_typed(fake: FakeServer) -> None:
    async def scenario() -> None:
        fake.servicer.script.refusals = [(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")]
        async with AsyncClient(fake.target) as client:
            with pytest.raises(ResourceExhaustedError, match="queue full"):
                await client.generate("hi")
            fake.servicer.script.fail_stream_after = 2
            texts = []
            with pytest.raises(UnavailableError, match="worker lost"):
                async for chunk in client.stream("hi"):
                    texts.append(chunk.text)
            assert texts == ["Hel", "lo"]

    asyncio.run(scenario())
    assert fake.servicer.script.calls == {"Generate": 1, "GenerateStream": 1}


@pytest.mark.parametrize("how", ["aclose", "break"])
def test_async_stream_stopped_early_cancels_the_call(fake: FakeServer, how: str) -> None:
    fake.servicer.script.endless_stream = True

    async def scenario() -> None:
        async with AsyncClient(fake.target) as client:
            if how == "aclose":
                chunks = client.stream("hi")
                assert (await chunks.__anext__()).text == "x"
                await chunks.aclose()
            else:
                async for _ in client.stream("hi"):
                    break
            for _ in range(100):
                if fake.servicer.script.stream_cancelled.is_set():
                    break
                await asyncio.sleep(0.05)
            assert fake.servicer.script.stream_cancelled.is_set()

    asyncio.run(scenario())


# -- CLI --------------------------------------------------------------------------------------


def test_cli_generate_prints_the_text(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", fake.target, "generate", "hi", "--max-tokens", "3", "--stop", "a", "b"]) == 0
    assert capsys.readouterr() == ("Hello world\n", "")
    assert main(["--target", fake.target, "generate", "hi", "--raw"]) == 0
    as_chat, raw = fake.servicer.script.requests
    # By default the prompt is one user turn of the chat template; --raw sends it as plain text.
    assert [(m.role, m.content) for m in as_chat.messages] == [("user", "hi")] and as_chat.prompt == ""
    assert (as_chat.max_tokens, list(as_chat.stop)) == (3, ["a", "b"])
    assert (raw.prompt, list(raw.messages)) == ("hi", [])


def test_cli_generate_stream_and_json(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", fake.target, "generate", "hi", "--stream"]) == 0
    assert capsys.readouterr().out == "Hello world\n"
    assert main(["--target", fake.target, "generate", "hi", "--json", "--seed", "4"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["text"] == "Hello world" and record["usage"]["prompt_tokens"] == 4
    assert main(["--target", fake.target, "generate", "hi", "--json", "--stream"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["finish_reason"] for line in lines] == [None, None, "length"]


def test_cli_chat_with_system(
    fake: FakeServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DUOSERVE_TARGET", fake.target)
    assert main(["chat", "hello", "--system", "be brief", "--temperature", "0.7"]) == 0
    assert capsys.readouterr().out == "Hello world\n"
    (request,) = fake.servicer.script.requests
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "hello")]
    assert request.temperature == pytest.approx(0.7)


def test_cli_models_tokenize_and_health(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--target", fake.target, "models"]) == 0
    assert capsys.readouterr().out.startswith("tiny  dtype=float32 backend=torch-cpu context=2048")
    assert main(["--target", fake.target, "models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["num_workers"] == 1
    assert main(["--target", fake.target, "tokenize", "abcde"]) == 0
    assert capsys.readouterr().out == "5\n"
    assert main(["--target", fake.target, "health"]) == 0
    assert capsys.readouterr().out == "SERVING\n"
    fake.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["--target", fake.target, "health"]) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"


def test_cli_errors_print_code_and_details(fake: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    fake.servicer.script.refusals = [(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be <= 2048")]
    assert main(["--target", fake.target, "generate", "hi", "--max-tokens", "5000"]) == 3
    assert capsys.readouterr() == ("", "error: INVALID_ARGUMENT: max_tokens: must be <= 2048\n")
    assert main(["--target", fake.target, "generate", "hi", "--max-tokens", "-1"]) == 3
    assert "error: INVALID_ARGUMENT: max_tokens: must be in" in capsys.readouterr().err
    assert main(["--target", dead_target(), "--retries", "0", "generate", "hi"]) == 14
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")

"""End to end: `duoserve serve` as real processes on loopback, driven through the SDK."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from duoserve_client import Client
from duoserve_client._proto import inference_pb2, inference_pb2_grpc
from duoserve_client.errors import DeadlineExceededError
from gpu_worker.host_memory import glibc_version, huge_page_environment, transparent_huge_pages
from tests.e2e.harness import (
    MAX_TOKENS,
    PROMPTS,
    USED_BLOCKS,
    ServerProcess,
    chat,
    drained_metrics,
    metrics,
    start_server,
)

pytestmark = pytest.mark.slow


def test_real_answer(reference: dict[str, tuple[str, list[int]]]) -> None:
    text, token_ids = reference["What is the capital of France?"]
    assert "Paris" in text
    assert len(token_ids) <= MAX_TOKENS


def test_list_models_reports_the_serving_configuration(smollm_server: ServerProcess) -> None:
    with Client(smollm_server.target) as client:
        (model,) = client.list_models()
    assert model.name == "SmolLM2-135M-Instruct.Q4_1"
    assert (model.context_length, model.vocab_size, model.dtype) == (8192, 49152, "float32")
    assert model.attention_backend == "cpu"  # the C decode kernel: a compiler is on every test machine
    assert model.block_size == 16
    assert model.kv_cache_blocks > 0 and model.kv_cache_tokens == 16 * model.kv_cache_blocks


def test_the_worker_holds_its_memory_in_huge_pages_where_linux_gives_them(
    smollm_server: ServerProcess,
) -> None:
    (worker,) = [p for p in smollm_server.descendants if "worker" in " ".join(p.cmdline())]
    with open(f"/proc/{worker.pid}/smaps_rollup") as rollup:
        huge_kib = next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages:"))
    mode = transparent_huge_pages()
    if huge_page_environment(os.environ, mode, glibc_version()) is not None:
        # The worker started itself again with the tunable: its weights (about 600 MB in float32)
        # and KV cache sit in 2 MiB pages.
        assert (
            "host memory: 2 MiB pages where aligned (transparent huge pages: madvise; glibc.malloc.hugetlb=1)"
            in smollm_server.log()
        )
        assert huge_kib > 256 << 10, huge_kib
    elif mode in ("never", "unavailable"):
        assert (
            f"host memory: 4 KiB pages (transparent huge pages: {mode}; glibc.malloc.hugetlb unset)"
            in smollm_server.log()
        )
        assert huge_kib == 0
    else:  # always, or the tunable already set by whoever started the tests: as Linux and glibc give
        assert "host memory: " in smollm_server.log()


def test_32_concurrent_streams_match_their_solo_results(
    smollm_server: ServerProcess, reference: dict[str, tuple[str, list[int]]]
) -> None:
    prompts = PROMPTS * 4

    def run(prompt: str) -> tuple[str, list[int], str | None]:
        with Client(smollm_server.target) as client:
            text, ids, finish = "", [], None
            for chunk in client.chat([("user", prompt)], max_tokens=MAX_TOKENS, stream=True):
                text += chunk.text
                ids += chunk.token_ids
                finish = chunk.finish_reason or finish
            return text, ids, finish

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(run, prompts))
    for prompt, (text, ids, finish) in zip(prompts, results, strict=True):
        assert (text, ids) == reference[prompt], prompt
        assert finish in ("stop", "length")


def test_unary_and_stream_agree_and_usage_counts_tokens(smollm_server: ServerProcess) -> None:
    with Client(smollm_server.target) as client:
        prompt_ids = client.tokenize("The quick brown fox")
        unary = client.generate("The quick brown fox", max_tokens=10, ignore_eos=True)
        chunks = list(client.stream("The quick brown fox", max_tokens=10, ignore_eos=True))
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == unary.token_ids
    assert unary.finish_reason == "length" and chunks[-1].finish_reason == "length"
    assert unary.usage.prompt_tokens == len(prompt_ids)
    assert unary.usage.completion_tokens == 10 and len(unary.token_ids) == 10
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(
    smollm_server: ServerProcess, reference: dict[str, tuple[str, list[int]]]
) -> None:
    full_text, _ = reference["List three prime numbers."]
    words = full_text.split()
    assert len(words) >= 3, full_text
    stop = words[2]
    with Client(smollm_server.target) as client:
        completion = chat(client, "List three prime numbers.", stop=[stop])
    assert completion.finish_reason == "stop"
    assert completion.text == full_text[: full_text.index(stop)]


def test_seeded_sampling_is_reproducible_and_logprobs_are_returned(smollm_server: ServerProcess) -> None:
    options = dict(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234, logprobs=3)
    with Client(smollm_server.target) as client:
        first = chat(client, "Tell me a story.", **options)
        second = chat(client, "Tell me a story.", **options)
    assert first.token_ids == second.token_ids
    assert first.logprobs is not None and len(first.logprobs) == len(first.token_ids)
    for entry in first.logprobs:
        assert len(entry.top) == 3 and entry.logprob <= 0.0
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def assert_pool_drains(server: ServerProcess) -> None:
    """Within drained_metrics' timeout, no KV block is in use and nothing is running."""
    values = drained_metrics(server)
    assert values[USED_BLOCKS] == 0
    assert values['duoserve_queue_size{queue="running"}'] == 0


def test_cancelled_stream_frees_its_blocks(smollm_server: ServerProcess) -> None:
    with Client(smollm_server.target) as client:
        stream = client.stream("Count from one to one thousand:", max_tokens=400, ignore_eos=True)
        for index, _chunk in enumerate(stream):
            if index == 3:
                break
        stream.close()
    assert_pool_drains(smollm_server)


def test_expired_deadline_aborts_the_request_and_frees_its_blocks(smollm_server: ServerProcess) -> None:
    with Client(smollm_server.target, retries=0) as client, pytest.raises(DeadlineExceededError):
        client.generate("Count from one to one thousand:", max_tokens=2000, ignore_eos=True, timeout=1.0)
    assert_pool_drains(smollm_server)


BAD_REQUESTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    (dict(prompt_token_ids=[1, 99999]), "prompt_token_ids[1]"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=9000), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", min_p=2.0), "min_p"),
    (dict(prompt="hi", top_k=10**6), "top_k"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(prompt="hi", frequency_penalty=-2.5), "frequency_penalty"),
    (dict(prompt="hi", stop=[""]), "stop[0]"),
    (dict(prompt="hi", stop_token_ids=[50000]), "stop_token_ids[0]"),
    (dict(prompt="hi", logprobs=100), "logprobs"),
    (dict(prompt="hi", model="no-such-model"), "model"),
    (dict(prompt="hi", priority=7), "priority"),
    (dict(prompt="hi", deadline_ms=0), "deadline_ms"),
    (dict(messages=[inference_pb2.ChatMessage(role="", content="x")]), "messages[0].role"),
]


@pytest.mark.parametrize(("fields", "field_name"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(
    smollm_server: ServerProcess, fields: dict[str, object], field_name: str
) -> None:
    with grpc.insecure_channel(smollm_server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as caught:
                call(inference_pb2.GenerateRequest(**fields), timeout=30)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(field_name + ":"), caught.value.details()


def test_prompt_longer_than_the_context_is_rejected(smollm_server: ServerProcess) -> None:
    with grpc.insecure_channel(smollm_server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=[17] * 8192), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("prompt:")


def test_small_kv_pool_preempts_but_every_result_is_unchanged() -> None:
    # 5 blocks of 16 tokens. Four prompts of 35-39 tokens, their first 24 the same chat template,
    # so one full block is shared through the prefix cache. Every request runs its full 24 tokens
    # and ends with 58-62 tokens in the cache: 1 shared + 3 own blocks, so each fits alone.
    # Admission needs only a prompt's 2 own blocks, so two requests run together on 1 + 2 + 2
    # blocks and neither reaches its third own block unless the other's are freed: one of them
    # is preempted whenever two run at once, whatever the arrival order or step timing.
    server = start_server(
        "--dtype", "float32", "--metrics-port", "0", "--num-kv-blocks", "5", "--block-size", "16"
    )
    prompts = PROMPTS[:4]
    try:
        with Client(server.target) as client:
            alone = {p: chat(client, p, ignore_eos=True) for p in prompts}
            assert metrics(server)["duoserve_preemptions_total"] == 0
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                together = list(pool.map(lambda p: chat(client, p, ignore_eos=True), prompts))
        for prompt, completion in zip(prompts, together, strict=True):
            assert len(completion.token_ids) == MAX_TOKENS, prompt
            assert (completion.text, completion.token_ids) == (alone[prompt].text, alone[prompt].token_ids), (
                prompt
            )
        values = drained_metrics(server)
        assert values["duoserve_preemptions_total"] > 0
        assert values[USED_BLOCKS] == 0
        # Every block is back: free, or holding a prefix the cache keeps for the next request.
        assert (
            values['duoserve_kv_cache_blocks{state="free"}']
            + values['duoserve_kv_cache_blocks{state="cached"}']
            == 5
        )
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


def test_health_is_not_serving_until_the_worker_is_ready_and_env_flags_apply() -> None:
    server = start_server(
        "--metrics-port", "0", env={"DUOSERVE_DTYPE": "bfloat16", "DUOSERVE_BLOCK_SIZE": "8"}, wait=False
    )
    seen: list[str] = []
    refused_before_ready: list[grpc.StatusCode] = []
    try:
        with Client(server.target, retries=0) as client:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and "SERVING" not in seen:
                try:
                    status = client.health(timeout=1.0)
                except Exception:
                    status = "NO_ANSWER"
                if status == "NOT_SERVING" and not refused_before_ready:
                    with pytest.raises(Exception) as caught:
                        client.generate("hi", max_tokens=1, timeout=5)
                    refused_before_ready.append(caught.value.code)
                seen.append(status)
                time.sleep(0.05)
            assert "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
            assert refused_before_ready == [grpc.StatusCode.UNAVAILABLE]
            (model,) = client.list_models()
            assert (model.dtype, model.block_size) == ("bfloat16", 8)
            assert "Paris" in chat(client, "What is the capital of France?").text
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


def test_sigterm_lets_an_inflight_stream_finish_or_end_unavailable() -> None:
    server = start_server("--dtype", "float32", "--metrics-port", "0", "--drain-timeout", "1")
    outcome: list[object] = []

    def consume() -> None:
        with Client(server.target, retries=0) as client:
            try:
                chunks = list(client.stream("Count to a thousand:", max_tokens=2000, ignore_eos=True))
                outcome.append(chunks[-1].finish_reason)
            except Exception as err:
                outcome.append(getattr(err, "code", err))

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(3)
    assert server.stop() == 0
    thread.join(30)
    assert outcome in (["length"], [grpc.StatusCode.UNAVAILABLE]), outcome
    assert server.leftovers() == []


def test_a_second_signal_stops_at_once_instead_of_draining() -> None:
    server = start_server("--dtype", "float32", "--metrics-port", "0", "--drain-timeout", "120")
    outcome: list[object] = []

    def consume() -> None:
        with Client(server.target, retries=0) as client:
            try:
                list(client.stream("Count to a thousand:", max_tokens=4000, ignore_eos=True))
                outcome.append("finished")
            except Exception as err:
                outcome.append(getattr(err, "code", err))

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(3)
    server.process.send_signal(signal.SIGTERM)  # drain: would wait up to 120 s for the stream
    time.sleep(1)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(15) == 0  # a requested stop, not a failure
    assert time.monotonic() - started < 10
    thread.join(30)
    assert outcome and outcome != ["finished"], outcome  # the stream was cut, not completed
    deadline = time.monotonic() + 10
    while server.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.leftovers() == []

"""End to end: DBO lanes, the prefix cache, priority classes, deadlines and backpressure on real processes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from duoserve_client import AsyncClient, Client
from duoserve_client.errors import DeadlineExceededError, DuoserveError, ResourceExhaustedError
from tests.e2e.harness import (
    PROMPTS,
    USED_BLOCKS,
    ServerProcess,
    chat,
    drained_metrics,
    metrics,
    start_server,
)

pytestmark = pytest.mark.slow

LONG_PROMPT = "Count from one to one thousand, one number per line:"


def run_all_at_once(server: ServerProcess) -> list[tuple[str, list[int]]]:
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool, Client(server.target) as client:
        completions = list(pool.map(lambda p: chat(client, p), PROMPTS))
    return [(c.text, c.token_ids) for c in completions]


@pytest.mark.parametrize(
    "flags",
    [
        ("--max-inflight", "1", "--no-prefix-cache"),
        ("--max-inflight", "2", "--min-lane-seqs", "1"),
        ("--max-inflight", "4", "--min-lane-seqs", "1", "--no-prefix-cache"),
        ("--no-lookahead",),
    ],
    ids=["dbo1-nocache", "dbo2-split", "dbo4-split-nocache", "no-lookahead"],
)
def test_dbo_lanes_and_prefix_cache_leave_greedy_outputs_unchanged(
    reference: dict[str, tuple[str, list[int]]],
    flags: tuple[str, ...],
) -> None:
    # `reference` ran each prompt alone, with the prefix cache on, the default lanes and lookahead.
    server = start_server("--dtype", "float32", "--metrics-port", "0", *flags)
    try:
        assert run_all_at_once(server) == [reference[p] for p in PROMPTS]
        values = drained_metrics(server)
        assert values[USED_BLOCKS] == 0
        if "--no-prefix-cache" in flags:
            assert values["duoserve_prefix_cache_hit_ratio"] == 0
            assert values['duoserve_kv_cache_blocks{state="cached"}'] == 0
    finally:
        assert server.stop() == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(smollm_server: ServerProcess) -> None:
    prompt = "Describe the water cycle in three short steps."
    with Client(smollm_server.target) as client:
        first = chat(client, prompt)
        second = chat(client, prompt)
    assert (second.text, second.token_ids) == (first.text, first.token_ids)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    # Every full block but the one holding the last prompt token (its logits are needed).
    assert second.usage.cached_prompt_tokens == (first.usage.prompt_tokens - 1) // 16 * 16 > 0
    assert metrics(smollm_server)["duoserve_prefix_cache_hit_ratio"] > 0


@pytest.fixture(scope="module")
def two_slot_server() -> Iterator[ServerProcess]:
    """Two sequences at a time and small queue limits: easy to saturate and to overload."""
    server = start_server(
        "--dtype",
        "float32",
        "--metrics-port",
        "0",
        "--max-num-seqs",
        "2",
        "--max-queued-requests",
        "8",
        "--max-queued-tokens",
        "1500",
    )
    yield server
    assert server.stop() == 0


def long_running(client: Client, tokens: int, priority: str = "batch") -> threading.Thread:
    def run() -> None:
        client.generate(LONG_PROMPT, max_tokens=tokens, ignore_eos=True, priority=priority)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_running(server: ServerProcess, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(server)['duoserve_queue_size{queue="running"}'] < count:
        assert time.monotonic() < deadline, "the load never started running"
        time.sleep(0.05)


def test_an_interactive_request_overtakes_a_saturating_batch_load(two_slot_server: ServerProcess) -> None:
    preemptions_before = metrics(two_slot_server)["duoserve_preemptions_total"]
    finished: list[str] = []
    with Client(two_slot_server.target) as client:
        threads = []
        for index in range(6):

            def run(index: int = index) -> None:
                completion = client.generate(LONG_PROMPT, max_tokens=48, ignore_eos=True, priority="batch")
                assert completion.finish_reason == "length" and len(completion.token_ids) == 48
                finished.append(f"batch{index}")

            threads.append(threading.Thread(target=run))
            threads[-1].start()
        wait_running(two_slot_server, 2)
        urgent = client.generate("Say hello.", max_tokens=8, ignore_eos=True, priority="interactive")
        finished.append("interactive")
        for thread in threads:
            thread.join(timeout=120)
    assert len(urgent.token_ids) == 8
    assert len(finished) == 7, finished
    # Both slots were taken by batch requests and four more waited: the interactive request
    # took a slot at once (a batch request was preempted) instead of queueing behind them.
    assert finished.index("interactive") < 3, finished
    assert metrics(two_slot_server)["duoserve_preemptions_total"] > preemptions_before


def test_an_interactive_prompt_runs_inside_the_batch_in_progress(smollm_server: ServerProcess) -> None:
    prompt = "Name three colours."
    with Client(smollm_server.target) as client:
        alone = client.generate(prompt, max_tokens=12, ignore_eos=True, priority="interactive")
        urgent_before = metrics(smollm_server)["duoserve_urgent_steps_total"]
        load = [long_running(client, 64) for _ in range(3)]
        wait_running(smollm_server, 3)
        loaded = client.generate(prompt, max_tokens=12, ignore_eos=True, priority="interactive")
        for thread in load:
            thread.join(timeout=120)
    # Its prompt went out as an urgent step beside the batch in flight, and the tokens are the
    # ones it gets on an idle server.
    assert metrics(smollm_server)["duoserve_urgent_steps_total"] > urgent_before
    assert loaded.token_ids == alone.token_ids
    assert drained_metrics(smollm_server)[USED_BLOCKS] == 0


def test_overload_is_refused_at_once_and_the_admitted_load_completes(
    two_slot_server: ServerProcess,
    reference: dict[str, tuple[str, list[int]]],
) -> None:
    prompts = PROMPTS + PROMPTS[:4]  # 12 requests at once; at most 8 waiting or running
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool, Client(two_slot_server.target) as client:

        def attempt(prompt: str) -> object:
            try:
                return chat(client, prompt)
            except ResourceExhaustedError as err:
                return err

        outcomes = list(pool.map(attempt, prompts))
    refused = [o for o in outcomes if isinstance(o, ResourceExhaustedError)]
    served = [
        (p, o) for p, o in zip(prompts, outcomes, strict=True) if not isinstance(o, ResourceExhaustedError)
    ]
    assert refused and len(served) >= 8, outcomes
    assert all("--max-queued-requests" in err.details for err in refused)
    for prompt, completion in served:
        assert (completion.text, completion.token_ids) == reference[prompt], prompt  # type: ignore[attr-defined]


def test_a_burst_of_thousands_of_streams_is_served_or_refused_by_the_admission(
    two_slot_server: ServerProcess,
) -> None:
    # Past 1000 calls waiting to be taken up, gRPC's core would end a share of them CANCELLED
    # before the scheduler saw them (scheduler/server.py, call_backlog_options).
    async def one(client: AsyncClient, index: int) -> str:
        try:
            stream = client.stream(prompt_token_ids=[17 + index % 50] * 8, max_tokens=1)
            async for _ in stream:
                pass
        except ResourceExhaustedError as err:
            assert "--max-queued-requests" in err.details, err
            return "refused"
        except DuoserveError as err:
            return err.code.name
        return "served"

    async def burst() -> list[str]:
        async with AsyncClient(two_slot_server.target, retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(3000)))

    outcomes = asyncio.run(burst())
    assert set(outcomes) <= {"served", "refused"}, sorted(set(outcomes))
    assert outcomes.count("served") >= 8
    assert drained_metrics(two_slot_server)[USED_BLOCKS] == 0


def test_queued_prompt_tokens_beyond_the_limit_are_refused(two_slot_server: ServerProcess) -> None:
    with Client(two_slot_server.target, retries=0) as client:
        load = [long_running(client, 64) for _ in range(2)]
        wait_running(two_slot_server, 2)
        # In the load's class, so it cannot preempt its way in: it waits until a load request ends.
        waiting = threading.Thread(
            target=lambda: client.generate(prompt_token_ids=[17] * 1000, max_tokens=1, priority="batch")
        )
        waiting.start()
        deadline = time.monotonic() + 10
        while metrics(two_slot_server)['duoserve_queue_size{queue="waiting"}'] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ResourceExhaustedError, match="--max-queued-tokens"):
            client.generate(prompt_token_ids=[17] * 600, max_tokens=1)
        for thread in (*load, waiting):
            thread.join(timeout=120)


def test_deadline_ms_fails_a_queued_request_without_running_it(two_slot_server: ServerProcess) -> None:
    with Client(two_slot_server.target, retries=0) as client:
        load = [long_running(client, 64, priority="standard") for _ in range(2)]
        wait_running(two_slot_server, 2)
        steps_before = metrics(two_slot_server)["duoserve_worker_steps_total"]
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="while queued") as caught:
            client.generate("Hello", max_tokens=4, deadline_ms=300)
        elapsed = time.monotonic() - started
        for thread in load:
            thread.join(timeout=120)
    assert 0.3 <= elapsed < 5.0, elapsed
    assert "deadline_ms=300" in caught.value.details
    assert metrics(two_slot_server)["duoserve_worker_steps_total"] > steps_before  # the load ran meanwhile


def test_worker_time_metrics_move_under_load(two_slot_server: ServerProcess) -> None:
    before = metrics(two_slot_server)
    with Client(two_slot_server.target) as client:
        load = long_running(client, 48, priority="standard")
        wait_running(two_slot_server, 1)
        during = metrics(two_slot_server)
        load.join(timeout=120)
    after = metrics(two_slot_server)
    assert during["duoserve_active_batches"] >= 1
    assert after["duoserve_active_batches"] == 0
    assert after["duoserve_worker_busy_seconds_total"] > before["duoserve_worker_busy_seconds_total"]
    assert after["duoserve_worker_steps_total"] >= before["duoserve_worker_steps_total"] + 48
    assert after["duoserve_worker_wait_seconds_total"] >= before["duoserve_worker_wait_seconds_total"]
    assert 0.0 <= after["duoserve_worker_idle_ratio"] < 0.5  # one batch in flight: mostly busy

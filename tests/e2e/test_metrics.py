"""The Prometheus endpoint under a short load: every named metric is there and moves as it should."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from duoserve_client import Client
from duoserve_client._proto import inference_pb2, inference_pb2_grpc
from tests.e2e.harness import ServerProcess, drained_metrics, metrics

pytestmark = pytest.mark.slow

NAMED = [
    'duoserve_queue_size{queue="waiting"}',
    'duoserve_queue_size{queue="running"}',
    "duoserve_active_batches",
    "duoserve_kv_cache_utilization",
    'duoserve_kv_cache_blocks{state="free"}',
    'duoserve_kv_cache_blocks{state="used"}',
    'duoserve_kv_cache_blocks{state="cached"}',
    "duoserve_prefix_cache_hit_ratio",
    "duoserve_preemptions_total",
    "duoserve_worker_idle_ratio",
    "duoserve_worker_busy_seconds_total",
    "duoserve_worker_wait_seconds_total",
    "duoserve_worker_sampling_seconds_total",
    "duoserve_worker_forecast_steps_total",
    "duoserve_worker_decode_steps_total",
    "duoserve_worker_decode_busy_seconds_total",
    "duoserve_worker_exposed_staging_seconds_total",
    "duoserve_worker_exposed_staging_full_seconds_total",
    "duoserve_prompt_tokens_total",
    "duoserve_generation_tokens_total",
    "duoserve_time_to_first_token_seconds_count",
    "duoserve_time_per_output_token_seconds_count",
    "duoserve_queue_time_seconds_count",
    "duoserve_e2e_request_latency_seconds_count",
]


def test_metrics_move_under_a_short_load_and_settle(smollm_server: ServerProcess) -> None:
    before = metrics(smollm_server)
    missing = [name for name in NAMED if name not in before]
    assert not missing, missing
    peak = {"running": 0.0, "utilization": 0.0, "active": 0.0}
    with Client(smollm_server.target) as client:
        threads = [
            threading.Thread(
                target=lambda i=i: client.generate(f"Story number {i}:", max_tokens=32, ignore_eos=True)
            )
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            now = metrics(smollm_server)
            peak["running"] = max(peak["running"], now['duoserve_queue_size{queue="running"}'])
            peak["utilization"] = max(peak["utilization"], now["duoserve_kv_cache_utilization"])
            peak["active"] = max(peak["active"], now["duoserve_active_batches"])
            time.sleep(0.05)
    with grpc.insecure_channel(smollm_server.target) as channel, pytest.raises(grpc.RpcError):
        inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(prompt=""), timeout=10
        )
    assert peak["running"] >= 2 and peak["utilization"] > 0 and peak["active"] >= 1
    after = drained_metrics(smollm_server)
    assert after["duoserve_kv_cache_utilization"] == 0, "KV utilization never fell back to 0"

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('duoserve_requests_total{code="OK",finish_reason="length"}') == 6
    assert grew('duoserve_requests_total{code="INVALID_ARGUMENT",finish_reason="none"}') == 1
    assert grew("duoserve_generation_tokens_total") == 6 * 32
    assert grew("duoserve_prompt_tokens_total") > 0
    for histogram in ("time_to_first_token", "time_per_output_token", "queue_time", "e2e_request_latency"):
        assert grew(f"duoserve_{histogram}_seconds_count") == 6, histogram
        assert grew(f"duoserve_{histogram}_seconds_sum") > 0, histogram
    assert after['duoserve_queue_size{queue="running"}'] == 0
    assert after["duoserve_worker_busy_seconds_total"] > before["duoserve_worker_busy_seconds_total"]
    # The CPU worker stages most decode steps from its forecast, built while the step before computed.
    assert 0 < grew("duoserve_worker_forecast_steps_total") <= grew("duoserve_worker_steps_total")
    # 6 requests of 32 tokens: at least 31 decode steps, fewer than all (the prompts took some).
    assert 31 <= grew("duoserve_worker_decode_steps_total") < grew("duoserve_worker_steps_total")
    assert 0 < grew("duoserve_worker_decode_busy_seconds_total") < grew("duoserve_worker_busy_seconds_total")
    # Every step that ended a prompt or decoded sampled (greedy: an argmax), a small part of its time.
    assert 0 < grew("duoserve_worker_sampling_seconds_total") < grew("duoserve_worker_busy_seconds_total") / 2
    # The first prompt step arrives at an idle worker and is staged in full, all of it exposed.
    exposed_full = grew("duoserve_worker_exposed_staging_full_seconds_total")
    assert 0 < exposed_full <= grew("duoserve_worker_exposed_staging_seconds_total")

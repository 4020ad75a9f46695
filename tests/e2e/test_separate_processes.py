"""`duoserve scheduler` and `duoserve worker` started on their own, talking over tcp://."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

import pytest

from duoserve_client import Client
from tests.e2e.harness import DUOSERVE, free_port

pytestmark = pytest.mark.slow


def test_scheduler_and_worker_run_alone_over_tcp() -> None:
    grpc_port, zmq_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{zmq_port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115
    env = {**os.environ, "DUOSERVE_DEBUG_CHECKS": "1"}
    scheduler = subprocess.Popen(
        [
            *(DUOSERVE, "scheduler", "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", "0"),
            *("--worker-address", address, "--num-kv-blocks", "256"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    worker = subprocess.Popen(
        [
            DUOSERVE,
            "worker",
            *("--scheduler-address", address, "--dtype", "float32", "--threads", "2"),
            *("--attention-backend", "torch"),  # the reference path, end to end
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        with Client(f"127.0.0.1:{grpc_port}") as client:
            client.wait_until_ready(240)
            (model,) = client.list_models()
            assert model.kv_cache_blocks == 256
            assert model.attention_backend == "torch"
            assert "Paris" in client.chat([("user", "What is the capital of France?")], max_tokens=24).text
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(30) == 0
        # The scheduler tells its worker to shut down; it exits on its own, cleanly.
        assert worker.wait(30) == 0
    finally:
        for process in (scheduler, worker):
            if process.poll() is None:
                process.kill()
        log.seek(0)
        output = log.read().decode(errors="replace")
    assert "shutdown requested by the scheduler" in output, output[-3000:]


def test_scheduler_stopped_before_any_worker_connects_exits_cleanly() -> None:
    grpc_port = free_port()
    scheduler = subprocess.Popen(
        [
            *(DUOSERVE, "scheduler", "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", "0"),
            *("--worker-address", f"tcp://127.0.0.1:{free_port()}"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with Client(f"127.0.0.1:{grpc_port}", retries=0) as client:
            status = "NO_ANSWER"
            for _ in range(200):
                try:
                    status = client.health(timeout=1.0)
                    break
                except Exception:
                    time.sleep(0.1)
        assert status == "NOT_SERVING"
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(30) == 0
    finally:
        if scheduler.poll() is None:
            scheduler.kill()

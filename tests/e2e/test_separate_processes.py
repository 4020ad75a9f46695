"""`duoserve scheduler` and `duoserve worker` started on their own, talking over tcp://."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from duoserve_client import Client
from duoserve_client.errors import UnavailableError
from gpu_worker.worker import HEARTBEAT_INTERVAL_S
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


def test_without_restarts_a_killed_worker_ends_its_requests_unavailable_and_health_drops() -> None:
    grpc_port, metrics_port, zmq_port = free_port(), free_port(), free_port()
    address = f"tcp://127.0.0.1:{zmq_port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115
    scheduler = subprocess.Popen(
        [
            *(DUOSERVE, "scheduler", "--host", "127.0.0.1", "--port", str(grpc_port)),
            *("--metrics-port", str(metrics_port), "--worker-address", address, "--num-kv-blocks", "256"),
            *("--worker-timeout", "2", "--no-restart-workers"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    worker = subprocess.Popen(
        [DUOSERVE, "worker", "--scheduler-address", address, "--dtype", "float32", "--threads", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with Client(f"127.0.0.1:{grpc_port}", retries=0) as client:
            client.wait_until_ready(240)
            stream = client.stream("Count from one to one thousand:", max_tokens=2000, ignore_eos=True)
            received = 0
            with pytest.raises(UnavailableError, match="the worker was lost: no heartbeat") as caught:
                for _chunk in stream:
                    received += 1
                    if received == 3:
                        worker.send_signal(signal.SIGKILL)
                        killed = time.monotonic()
            noticed = time.monotonic() - killed
            # --worker-timeout 2 counts from the last heartbeat, which came up to one interval
            # before the kill; the scheduler looks every 0.25 s.
            assert 2.0 - HEARTBEAT_INTERVAL_S <= noticed < 6.0, noticed
            assert "UNAVAILABLE" in str(caught.value)
            assert client.health() == "NOT_SERVING"
            with pytest.raises(UnavailableError):
                client.generate("Hello", max_tokens=2)
        with pytest.raises(urllib.error.HTTPError) as http_error:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=5)
        assert http_error.value.code == 503
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(30) == 0  # a requested stop is a clean stop, worker or not
    finally:
        for process in (scheduler, worker):
            if process.poll() is None:
                process.kill()
                process.wait()

"""CURVE on the scheduler ↔ worker link: keys required off loopback, wrong or missing keys refused."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from duoserve_client import Client
from duoserve_client.errors import UnavailableError
from gpu_worker.config import WorkerConfig, WorkerConfigError
from scheduler.config import ConfigError, SchedulerConfig
from scheduler.curve import faces_network
from tests.e2e.harness import DUOSERVE, free_port

pytestmark = pytest.mark.slow


def test_only_loopback_and_ipc_addresses_go_without_keys() -> None:
    assert not faces_network("ipc:///tmp/x.sock")
    assert not faces_network("tcp://127.0.0.1:5555") and not faces_network("tcp://localhost:5555")
    assert not faces_network("tcp://[::1]:5555")
    assert faces_network("tcp://0.0.0.0:5555") and faces_network("tcp://10.1.2.3:5555")
    assert faces_network("tcp://scheduler:5555")
    with pytest.raises(ConfigError, match=r"--worker-address='tcp://0\.0\.0\.0:5555' is invalid"):
        SchedulerConfig(model="m", worker_address="tcp://0.0.0.0:5555")
    with pytest.raises(WorkerConfigError, match=r"--scheduler-address='tcp://scheduler:5555' is invalid"):
        WorkerConfig(model="m", scheduler_address="tcp://scheduler:5555")
    SchedulerConfig(
        model="m", worker_address="tcp://0.0.0.0:5555", zmq_curve_secret="s", zmq_curve_authorized="a"
    )


REFUSED_GRACE_S = 4.0  # CURVE refuses a worker's handshake in milliseconds
WORKER_SAID_HELLO = re.compile(r"gpu_worker\.worker: said Hello to the scheduler")  # before it loads


def logged(log: IO[bytes]) -> str:
    """What the processes wrote so far; pread leaves the offset they share where it is."""
    return os.pread(log.fileno(), os.fstat(log.fileno()).st_size, 0).decode(errors="replace")


def keys(directory: Path) -> Path:
    subprocess.run([DUOSERVE, "keys", str(directory)], check=True, capture_output=True)
    return directory


def test_a_worker_needs_an_authorized_key(tmp_path: Path) -> None:
    good, other = keys(tmp_path / "good"), keys(tmp_path / "other")
    grpc_port, zmq_port = free_port(), free_port()
    address = f"tcp://127.0.0.1:{zmq_port}"
    log = tempfile.TemporaryFile()  # noqa: SIM115
    scheduler = subprocess.Popen(
        [
            *(DUOSERVE, "scheduler", "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", "0"),
            *("--worker-address", address, "--num-kv-blocks", "256"),
            *("--zmq-curve-secret", str(good / "scheduler.key_secret")),
            *("--zmq-curve-authorized", str(good / "authorized")),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    worker_command = [
        DUOSERVE,
        "worker",
        "--scheduler-address",
        address,
        "--dtype",
        "float32",
        "--threads",
        "2",
    ]
    refused = [
        subprocess.Popen(worker_command, stdout=log, stderr=subprocess.STDOUT),  # no key at all
        subprocess.Popen(  # a key pair the scheduler never authorized
            [
                *worker_command,
                *("--zmq-curve-worker-secret", str(other / "worker.key_secret")),
                *("--zmq-curve-server-key", str(good / "scheduler.key")),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        ),
    ]
    accepted = None
    try:
        with Client(f"127.0.0.1:{grpc_port}") as client:
            # Both refused workers try to say Hello; the scheduler must stay without a worker for
            # a while after the second has tried.
            deadline, both_tried = time.monotonic() + 120, None
            while both_tried is None or time.monotonic() < both_tried + REFUSED_GRACE_S:
                try:
                    status = client.health(timeout=2)
                except UnavailableError:  # the scheduler is still starting
                    status = "STARTING"
                assert status != "SERVING", "a worker without an authorized key got in"
                if both_tried is None and len(WORKER_SAID_HELLO.findall(logged(log))) >= 2:
                    both_tried = time.monotonic()
                assert time.monotonic() < deadline, "the refused workers never said Hello:\n" + logged(log)
                time.sleep(0.5)
            # Neither got a Configure, so neither loaded the model.
            assert "gpu_worker.startup: loaded" not in logged(log)
            accepted = subprocess.Popen(
                [
                    *worker_command,
                    *("--zmq-curve-worker-secret", str(good / "worker.key_secret")),
                    *("--zmq-curve-server-key", str(good / "scheduler.key")),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            client.wait_until_ready(240)
            assert "Paris" in client.chat([("user", "What is the capital of France?")], max_tokens=16).text
    finally:
        for process in (scheduler, *refused, *([accepted] if accepted else [])):
            if process.poll() is None:
                process.kill()
                process.wait()

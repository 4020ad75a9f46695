"""A worker killed mid-stream under `duoserve serve`: the launcher starts a replacement, the
scheduler re-admits the requests, and every stream continues where it stopped."""

from __future__ import annotations

import re
import signal
import threading
import time

import psutil
import pytest

from duoserve_client import Client
from tests.e2e.harness import ServerProcess, start_server

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about a lighthouse keeper."
TOKENS = 40


def worker_process(server: ServerProcess) -> psutil.Process:
    for child in psutil.Process(server.process.pid).children(recursive=True):
        if "worker" in " ".join(child.cmdline()):
            return child
    raise AssertionError("no worker process under the launcher")


def test_streams_resume_on_a_replacement_worker_without_losing_or_repeating_tokens() -> None:
    server = start_server("--dtype", "float32", "--metrics-port", "0", "--worker-timeout", "2")
    try:
        with Client(server.target) as client:
            solo = client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids
            old_worker = worker_process(server)
            others: list[list[int]] = []

            def other() -> None:  # a second stream, queued or running when the worker dies
                others.append(client.generate(PROMPT, max_tokens=TOKENS, ignore_eos=True).token_ids)

            thread = threading.Thread(target=other)
            tokens: list[int] = []
            arrivals: list[float] = []
            killed = 0.0
            for chunk in client.stream(PROMPT, max_tokens=TOKENS, ignore_eos=True, timeout=240):
                tokens += chunk.token_ids
                arrivals.append(time.monotonic())
                if len(tokens) == 8 and not killed:
                    thread.start()
                    old_worker.send_signal(signal.SIGKILL)
                    killed = time.monotonic()
            thread.join(timeout=240)
        assert tokens == solo  # greedy: the same tokens, none lost or repeated
        assert others == [solo]
        resumed = next(t for t in arrivals if t > killed)
        log = server.log()
        # The heartbeat times out after 2 s; a replacement that says Hello sooner is noticed first.
        lost = r"the worker was lost: (no heartbeat|worker 0 \(pid \d+\) connected in its place)"
        assert re.search(lost, log), log[-3000:]
        assert "replacement worker ready" in log and "restarting it in" in log
        assert worker_process(server).pid != old_worker.pid
        assert resumed - killed < 120
        with Client(server.target) as client:
            assert client.health() == "SERVING"
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []

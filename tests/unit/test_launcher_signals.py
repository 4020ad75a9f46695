"""The launcher's stop signal: SIGTERM and SIGINT wake its wait, and the handler takes no lock."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from scheduler.launcher import StopSignal


@pytest.fixture
def stop() -> Iterator[StopSignal]:
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield StopSignal()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_wait_at_once(stop: StopSignal, sig: int) -> None:
    started = time.monotonic()
    assert not stop.wait(0.2)
    assert time.monotonic() - started >= 0.19
    threading.Timer(0.1, os.kill, (os.getpid(), sig)).start()
    started = time.monotonic()
    assert stop.wait(30)
    assert time.monotonic() - started < 5
    assert stop.wait(30)  # and stays received
    assert time.monotonic() - started < 5


def test_a_storm_of_signals_during_short_waits_never_blocks_the_waiter(stop: StopSignal) -> None:
    """The handler runs wherever the main thread is: in the wait, or between its steps. Here it
    lands at thousands of such points, and every wait still returns."""
    done = threading.Event()

    def storm() -> None:
        while not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.0002)

    sender = threading.Thread(target=storm, daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 1.0
        waits = 0
        while time.monotonic() < deadline:
            stop.wait(0)
            waits += 1
    finally:
        done.set()
        sender.join(5)
    assert stop.received and waits > 100

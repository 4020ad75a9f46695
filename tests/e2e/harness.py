"""Starts real `duoserve serve` processes on loopback for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from duoserve_client import Client

DUOSERVE = str(Path(sys.executable).parent / "duoserve")
READY_TIMEOUT_S = 240.0
# Where servers write their logs: tests/conftest.py points it into pytest's temporary directory,
# which keeps the last few sessions' and removes older ones; the system's otherwise.
LOG_DIR: Path | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class ServerProcess:
    """A running `duoserve serve` and every process it started."""

    target: str
    process: subprocess.Popen[bytes]
    log_path: Path
    descendants: list[psutil.Process] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the launcher and wait for it; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(
                f"duoserve serve did not stop within {timeout} s:\n{self.log()[-4000:]}"
            ) from None

    def leftovers(self) -> list[psutil.Process]:
        """Processes it started that are still alive."""
        return [p for p in self.descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def start_server(*flags: str, env: dict[str, str] | None = None, wait: bool = True) -> ServerProcess:
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115
        prefix="duoserve-test-", suffix=".log", dir=LOG_DIR, delete=False
    )
    # TRITON_INTERPRET=1 (tests/conftest.py, on a machine without a GPU) is for the kernel tests: a
    # server runs as a user's would, without it, unless a test asks for it.
    environment = {**os.environ, "DUOSERVE_DEBUG_CHECKS": "1", "TRITON_INTERPRET": "0", **(env or {})}
    command = [
        DUOSERVE,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-address",
        f"ipc://{tempfile.gettempdir()}/duoserve-test-{port}.sock",
        "--threads",
        "2",
        # A small pool starts fast; tests that need more or less say so (a later flag wins).
        "--num-kv-blocks",
        "512",
        *flags,
    ]
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=environment)
    server = ServerProcess(f"127.0.0.1:{port}", process, Path(log_file.name))
    if wait:
        wait_until_serving(server)
    return server


def wait_until_serving(server: ServerProcess, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with Client(server.target, retries=0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise AssertionError(
                    f"duoserve serve exited with {server.process.returncode}:\n{server.log()[-4000:]}"
                )
            try:
                if client.health(timeout=1.0) == "SERVING":
                    server.descendants = psutil.Process(server.process.pid).children(recursive=True)
                    return
            except Exception:
                pass
            time.sleep(0.3)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"duoserve serve not SERVING after {timeout} s:\n{server.log()[-4000:]}")


# ------------------------------------------------------------------ shared by the e2e tests

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painter.",
    "Give me a synonym for happy.",
]
MAX_TOKENS = 24


def serve_greedy(
    server: ServerProcess, texts: list[str], max_tokens: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Each text tokenized by the server and generated greedily for max_tokens (end-of-sequence
    tokens taken like any other), one request at a time; then the server stopped, which must
    exit cleanly. (prompts, outputs) as token ids."""
    try:
        with Client(server.target) as client:
            prompts = [client.tokenize(text) for text in texts]
            outputs = [
                client.generate(prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True).token_ids
                for p in prompts
            ]
    finally:
        assert server.stop() == 0
    return prompts, outputs


def chat(client: Client, prompt: str, **options: object) -> object:
    options.setdefault("max_tokens", MAX_TOKENS)
    return client.chat([("user", prompt)], **options)


def metrics(server: ServerProcess) -> dict[str, float]:
    port = re.findall(r"/health and /metrics on [\w.]+:(\d+)", server.log())[-1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


USED_BLOCKS = 'duoserve_kv_cache_blocks{state="used"}'


def drained_metrics(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once no KV block is in use, or at `timeout`. A request's last token can reach
    its client while a lookahead step that holds its blocks is still on the worker; the blocks
    come back with that step's result. A leak stays in use past the timeout."""
    deadline = time.monotonic() + timeout
    values = metrics(server)
    while values[USED_BLOCKS] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        values = metrics(server)
    return values

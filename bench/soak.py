"""Soak test on loopback: concurrent clients, random cancellations and deadlines, a worker killed mid-run.

    python bench/soak.py                           # 8 clients x 12 requests, one worker kill
    python bench/soak.py --clients 4 --requests 4  # the short version CI runs

Every request must end in one of these ways, and the run fails otherwise:
- completed, with exactly the greedy tokens the same prompt gets alone;
- cancelled by its client, or past its client deadline (the chosen fates);
- UNAVAILABLE only if it was sent while the worker was being replaced.
Afterwards the KV pool must be back to full, the scheduler's memory and open files must not
have grown past a bound, and after shutdown no process may be left.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from servers import free_port

from duoserve_client import Client, DuoserveError

PROMPTS = [
    "Tell me about the moon.",
    "List four colours.",
    "Why do cats purr?",
    "Describe a forest at dawn.",
    "What is a prime number?",
    "Write two lines about rain.",
]


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise KeyError(name)


@dataclass(slots=True)
class Tally:
    """What the clients saw, shared by their threads: every change is made under `lock`."""

    reference: dict[str, list[int]]  # each prompt's greedy tokens, asked alone
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    errors: list[Refused] = field(default_factory=list)

    def add(self, outcome: str, failure: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if failure is not None:
                self.failures.append(failure)


@dataclass(slots=True, frozen=True)
class Refused:
    fate: str  # what its client meant to do: complete, cancel or deadline
    prompt: str
    code: str  # the gRPC status's name
    details: str
    sent: float  # time.monotonic() when it was sent


@dataclass(slots=True)
class Outage:
    """From the worker's kill until the server says SERVING again; infinite both ways without a kill."""

    killed: float = float("inf")
    serving: float = float("-inf")


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12, help="per client")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill the worker")
    parser.add_argument(
        "--rss-growth-mb", type=float, default=150.0, help="bound on the scheduler's RSS growth"
    )
    parser.add_argument(
        "--worker-rss-growth-mb",
        type=float,
        default=400.0,
        help="bound on the replacement worker's RSS growth",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--log", type=Path, help="the server's log (default: a new file in the temporary directory)"
    )
    return parser.parse_args(argv)


def child(server: subprocess.Popen[bytes], title: str) -> psutil.Process:
    """The server's child process whose command line names `title` (scheduler or worker)."""
    return next(p for p in psutil.Process(server.pid).children() if title in " ".join(p.cmdline()))


def one_client(target: str, args: argparse.Namespace, index: int, tally: Tally) -> None:
    """`args.requests` requests, each given a fate at random: completed, cancelled mid-stream or
    past a short deadline. Completed and cancelled ones must carry the prompt's greedy tokens."""
    local = random.Random(args.seed * 1000 + index)
    with Client(target, retries=3) as client:
        for _ in range(args.requests):
            prompt = local.choice(PROMPTS)
            fate = local.choices(["complete", "cancel", "deadline"], weights=[6, 2, 2])[0]
            expected = tally.reference[prompt]
            sent = time.monotonic()
            try:
                if fate == "deadline":
                    timeout = local.uniform(0.2, 1.5)
                    tokens = client.generate(prompt, max_tokens=args.max_tokens, timeout=timeout).token_ids
                else:
                    stop_after = local.randint(1, 5) if fate == "cancel" else None
                    tokens = streamed(client, prompt, args.max_tokens, stop_after)
                    if stop_after is not None and len(tokens) < args.max_tokens:
                        diverged = tokens != expected[: len(tokens)]
                        tally.add("cancelled", f"cancelled stream diverged: {prompt!r}" if diverged else None)
                        continue
                wrong = f"wrong tokens for {prompt!r}: {tokens} != {expected}"
                tally.add("completed", wrong if tokens != expected else None)
            except DuoserveError as err:
                with tally.lock:
                    tally.outcomes[err.code.name.lower()] += 1
                    tally.errors.append(Refused(fate, prompt, err.code.name, err.details, sent))


def streamed(client: Client, prompt: str, max_tokens: int, stop_after: int | None) -> list[int]:
    """The tokens of a stream, closed by the client once it holds `stop_after` of them."""
    tokens: list[int] = []
    stream = client.stream(prompt, max_tokens=max_tokens, timeout=300)
    for chunk in stream:
        tokens += chunk.token_ids
        if stop_after is not None and len(tokens) >= stop_after:
            stream.close()
            break
    return tokens


def kill_worker(
    server: subprocess.Popen[bytes], target: str, outage: Outage, report: dict[str, Any]
) -> psutil.Process:
    """SIGKILL the worker, time how long until the server notices and until it serves again,
    and return the worker that replaced it."""
    worker = child(server, "worker")
    outage.killed = time.monotonic()
    worker.send_signal(signal.SIGKILL)
    with Client(target) as client:
        noticed_by = time.monotonic() + 30
        while client.health() == "SERVING" and time.monotonic() < noticed_by:
            time.sleep(0.05)
        report["noticed_s"] = time.monotonic() - outage.killed
        client.wait_until_ready(240)
    replacement = child(server, "worker")
    outage.serving = time.monotonic()
    report["outage_s"] = outage.serving - outage.killed
    return replacement


def unexcused(errors: list[Refused], outage: Outage) -> list[str]:
    """The errors that no chosen fate or the worker's replacement accounts for."""
    failures = []
    for error in errors:
        if error.code == "DEADLINE_EXCEEDED" and error.fate == "deadline":
            continue  # the fate its client chose
        if error.code == "UNAVAILABLE" and outage.killed - 1 <= error.sent <= outage.serving:
            continue  # sent while the worker was being replaced, and the SDK's retries ran out
        failures.append(f"{error.fate} request for {error.prompt!r} failed: {error.code}: {error.details}")
    return failures


def blocks_in_use(metrics_port: int, wait_s: float = 15.0) -> float:
    """The KV blocks still held once up to `wait_s` has passed for them to come back."""
    name = 'duoserve_kv_cache_blocks{state="used"}'
    deadline = time.monotonic() + wait_s
    while metric(metrics_port, name) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    return metric(metrics_port, name)


def stop(server: subprocess.Popen[bytes]) -> list[str]:
    """SIGTERM the server; a failure for a non-zero exit and for every process it left behind."""
    children = psutil.Process(server.pid).children(recursive=True)
    server.send_signal(signal.SIGTERM)
    status = server.wait(120)
    time.sleep(1)
    left = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    failures = [f"duoserve serve exited with {status}"] if status != 0 else []
    if left:
        failures.append(f"processes left behind: {left}")
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments(argv)
    rng = random.Random(args.seed)
    grpc_port, metrics_port = free_port(), free_port()
    log_path = args.log or Path(tempfile.mkstemp(prefix="duoserve-soak-", suffix=".log")[1])
    command = [
        str(Path(sys.executable).parent / "duoserve"),
        *("serve", "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", str(metrics_port)),
        *("--dtype", "float32", "--worker-timeout", "2", "--num-kv-blocks", "256", "--threads", "2"),
    ]
    print(f"# {' '.join(command)}  (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    failures: list[str] = []
    tally = Tally(reference={})
    report: dict[str, Any] = {"command": command}
    target = f"127.0.0.1:{grpc_port}"
    try:
        with Client(target) as client:
            client.wait_until_ready(240)
            tally.reference = {p: client.generate(p, max_tokens=args.max_tokens).token_ids for p in PROMPTS}
        scheduler = child(server, "scheduler")
        rss_before, fds_before = scheduler.memory_info().rss, scheduler.num_fds()
        threads = [
            threading.Thread(target=one_client, args=(target, args, i, tally)) for i in range(args.clients)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        outage = Outage()
        if args.kill:
            time.sleep(rng.uniform(2.0, 4.0))
            replacement = kill_worker(server, target, outage, report)
            worker_rss_before = replacement.memory_info().rss
        for thread in threads:
            thread.join(timeout=600)
            if thread.is_alive():
                failures.append("a client never finished (a request hung)")
        report["wall_s"] = time.monotonic() - started
        failures += tally.failures + unexcused(tally.errors, outage)
        used = blocks_in_use(metrics_port)
        if used:
            failures.append(f"{used:.0f} KV blocks still in use after the run")
        if args.kill:
            worker_growth = (replacement.memory_info().rss - worker_rss_before) / 2**20
            report["worker_rss_growth_mb"] = worker_growth
            if worker_growth > args.worker_rss_growth_mb:
                failures.append(f"the replacement worker's RSS grew by {worker_growth:.0f} MB")
        rss_growth = (scheduler.memory_info().rss - rss_before) / 2**20
        fds_growth = scheduler.num_fds() - fds_before
        report.update({"scheduler_rss_growth_mb": rss_growth, "scheduler_fd_growth": fds_growth})
        if rss_growth > args.rss_growth_mb:
            failures.append(f"scheduler RSS grew by {rss_growth:.0f} MB")
        if fds_growth > 16:
            failures.append(f"scheduler holds {fds_growth} more open files")
    finally:
        failures += stop(server)
    report.update({"outcomes": dict(tally.outcomes), "failures": failures})
    print(json.dumps(report, indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

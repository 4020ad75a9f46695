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


def main(argv: Sequence[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
    outcomes: Counter[str] = Counter()
    report: dict[str, Any] = {"command": command}
    target = f"127.0.0.1:{grpc_port}"
    try:
        with Client(target) as client:
            client.wait_until_ready(240)
            reference = {p: client.generate(p, max_tokens=args.max_tokens).token_ids for p in PROMPTS}
        scheduler = next(
            p for p in psutil.Process(server.pid).children() if "scheduler" in " ".join(p.cmdline())
        )
        rss_before, fds_before = scheduler.memory_info().rss, scheduler.num_fds()
        outage = [float("inf"), float("-inf")]  # [killed at, serving again at]
        lock = threading.Lock()
        errors: list[tuple[str, str, str, str, float]] = []  # fate, prompt, code, details, sent at

        def one_client(index: int) -> None:
            local = random.Random(args.seed * 1000 + index)
            with Client(target, retries=3) as c:
                for _ in range(args.requests):
                    prompt = local.choice(PROMPTS)
                    fate = local.choices(["complete", "cancel", "deadline"], weights=[6, 2, 2])[0]
                    sent = time.monotonic()
                    try:
                        if fate == "deadline":
                            tokens = c.generate(
                                prompt, max_tokens=args.max_tokens, timeout=local.uniform(0.2, 1.5)
                            ).token_ids
                        else:
                            tokens = []
                            stop_after = local.randint(1, 5) if fate == "cancel" else None
                            stream = c.stream(prompt, max_tokens=args.max_tokens, timeout=300)
                            for chunk in stream:
                                tokens += chunk.token_ids
                                if stop_after is not None and len(tokens) >= stop_after:
                                    stream.close()
                                    break
                            if stop_after is not None and len(tokens) < args.max_tokens:
                                with lock:
                                    outcomes["cancelled"] += 1
                                if tokens != reference[prompt][: len(tokens)]:
                                    with lock:
                                        failures.append(f"cancelled stream diverged: {prompt!r}")
                                continue
                        with lock:
                            outcomes["completed"] += 1
                            if tokens != reference[prompt]:
                                failures.append(
                                    f"wrong tokens for {prompt!r}: {tokens} != {reference[prompt]}"
                                )
                    except DuoserveError as err:
                        with lock:
                            outcomes[err.code.name.lower()] += 1
                            errors.append((fate, prompt, err.code.name, err.details, sent))

        threads = [threading.Thread(target=one_client, args=(i,)) for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        if args.kill:
            time.sleep(rng.uniform(2.0, 4.0))
            worker = next(
                p for p in psutil.Process(server.pid).children() if "worker" in " ".join(p.cmdline())
            )
            with lock:
                outage[0] = time.monotonic()
            worker.send_signal(signal.SIGKILL)
            with Client(target) as c:
                noticed_by = time.monotonic() + 30
                while c.health() == "SERVING" and time.monotonic() < noticed_by:
                    time.sleep(0.05)
                report["noticed_s"] = time.monotonic() - outage[0]
                c.wait_until_ready(240)
            replacement = next(
                p for p in psutil.Process(server.pid).children() if "worker" in " ".join(p.cmdline())
            )
            worker_rss_before = replacement.memory_info().rss
            with lock:
                outage[1] = time.monotonic()
            report["outage_s"] = outage[1] - outage[0]
        for thread in threads:
            thread.join(timeout=600)
            if thread.is_alive():
                failures.append("a client never finished (a request hung)")
        report["wall_s"] = time.monotonic() - started
        for fate, prompt, code, details, sent in errors:
            if code == "DEADLINE_EXCEEDED" and fate == "deadline":
                continue  # the fate its client chose
            if code == "UNAVAILABLE" and outage[0] - 1 <= sent <= outage[1]:
                continue  # sent while the worker was being replaced, and the SDK's retries ran out
            failures.append(f"{fate} request for {prompt!r} failed: {code}: {details}")
        deadline = time.monotonic() + 15
        while (
            metric(metrics_port, 'duoserve_kv_cache_blocks{state="used"}') > 0 and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        used = metric(metrics_port, 'duoserve_kv_cache_blocks{state="used"}')
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
        children = psutil.Process(server.pid).children(recursive=True)
        server.send_signal(signal.SIGTERM)
        status = server.wait(120)
        time.sleep(1)
        left = [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if status != 0:
            failures.append(f"duoserve serve exited with {status}")
        if left:
            failures.append(f"processes left behind: {left}")
    report.update({"outcomes": dict(outcomes), "failures": failures})
    print(json.dumps(report, indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

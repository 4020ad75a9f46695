"""Start-up time: `duoserve serve` launched → health SERVING, and where the worker's part goes.

    python bench/startup.py [--repeats 5] [--checkout DIR ...] [--server-args "..."] [--cold]

Each repeat launches the server, waits until its health check says SERVING, sends one request
(it must come back), and stops it. Printed per start: seconds from launch to SERVING, and from
the worker's log its phases: launch → Hello (imports, model config), weights loaded, KV cache
allocated, warm-up; then the worker's resident memory after that request and its peak so far.
With several `--checkout`s (git worktrees of other commits, run with this interpreter and their
own sources), the starts take turns, so that each pair sees the same machine.
With `--cold` each start gets an empty kernel cache, so it compiles every kernel it uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import psutil
from servers import free_port

from duoserve_client import Client

REPO = Path(__file__).resolve().parent.parent
PHASES = {
    "hello_s": r"said Hello to the scheduler",
    "loaded_s": r"loaded .* in [\d.]+ s",
    "ready_s": r"worker ready: ",
    "serving_s": r"duoserve is serving",
}


def stamps(log: str, launched: float) -> dict[str, float]:
    """Seconds after `launched` (wall clock) of each phase's first log line."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        for phase, pattern in PHASES.items():
            if phase not in found and re.search(pattern, line):
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[phase] = stamp - launched
    return found


def worker_memory_mb(launcher_pid: int) -> dict[str, float]:
    """The worker's resident memory now and at its peak (Linux's VmRSS and VmHWM), in MB."""
    workers = [
        p for p in psutil.Process(launcher_pid).children(recursive=True) if "worker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 1, f"expected one worker process, found {len(workers)}"
    status = Path(f"/proc/{workers[0].pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kilobytes = {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}
    return {"worker_rss_mb": kilobytes["VmRSS"] / 1024, "worker_peak_mb": kilobytes["VmHWM"] / 1024}


def start_once(checkout: Path, server_args: list[str], timeout: float, cold: bool) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ)
    if cold:
        env["DUOSERVE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="duoserve-cold-kernels-")
    log_path = Path(tempfile.mkstemp(prefix="duoserve-startup-", suffix=".log")[1])
    command = [
        sys.executable,
        *("-m", "scheduler.cli", "serve", "--host", "127.0.0.1", "--port", str(port)),
        *("--metrics-port", "0", *server_args),
    ]
    with log_path.open("w") as log:
        launched_wall, launched = time.time(), time.monotonic()
        server = subprocess.Popen(command, cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_ready(timeout)
            serving = time.monotonic() - launched
            reply = client.generate("What is the capital of France?", max_tokens=8)
            assert reply.token_ids, "the first request came back empty"
            memory = worker_memory_mb(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        if cold:
            shutil.rmtree(env["DUOSERVE_KERNEL_CACHE"], ignore_errors=True)
    row = stamps(log_path.read_text(), launched_wall)
    row["client_serving_s"] = serving
    row.update(memory)
    log_path.unlink()
    return row


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--checkout", type=Path, action="append", help="a source tree to start (default: this one)"
    )
    parser.add_argument("--server-args", default="", help="extra `duoserve serve` flags")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--cold", action="store_true", help="an empty kernel cache for every start")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    checkouts = args.checkout or [REPO]
    server_args = shlex.split(args.server_args)
    if args.cold:
        print(f"# serve {' '.join(server_args)}; every start with an empty kernel cache")
    else:
        print(f"# serve {' '.join(server_args)}; first start of each checkout not counted (kernel builds)")
        for checkout in checkouts:
            start_once(checkout, server_args, args.timeout, cold=False)
    rows: dict[str, list[dict[str, float]]] = {str(c): [] for c in checkouts}
    header = (
        f"{'checkout':<28} {'SERVING s':>10} {'Hello s':>8} {'loaded s':>9} {'ready s':>8}"
        f" {'RSS MB':>7} {'peak MB':>8}"
    )
    print(header)
    for _ in range(args.repeats):
        for checkout in checkouts:
            row = start_once(checkout, server_args, args.timeout, args.cold)
            rows[str(checkout)].append(row)
            print(
                f"{checkout.name:<28} {row['client_serving_s']:>10.2f} {row.get('hello_s', float('nan')):>8.2f}"
                f" {row.get('loaded_s', float('nan')):>9.2f} {row.get('ready_s', float('nan')):>8.2f}"
                f" {row['worker_rss_mb']:>7.0f} {row['worker_peak_mb']:>8.0f}"
            )
    for checkout, runs in rows.items():
        median = statistics.median(r["client_serving_s"] for r in runs)
        rss = statistics.median(r["worker_rss_mb"] for r in runs)
        print(f"median launch → SERVING, {Path(checkout).name}: {median:.2f} s; worker RSS {rss:.0f} MB")
    if args.json:
        args.json.write_text(
            json.dumps({"server_args": server_args, "cold": args.cold, "starts": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

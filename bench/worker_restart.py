"""Worker-loss timings: kill the worker mid-stream under `duoserve serve` and time the recovery.

    python bench/worker_restart.py [--dtype float32] [--worker-timeout 2] [--repeats 3]

Prints, per kill: worker killed → scheduler notices (no heartbeat for --worker-timeout),
→ replacement worker ready (launcher backoff + model load + warm-up), → first resumed token
at the client; and checks the resumed stream equals the same request's uninterrupted output.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
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

PROMPT = "Write a long story about a lighthouse keeper."


def log_time(log: str, pattern: str, after: float) -> float:
    """Wall-clock time of the first log line matching `pattern` written after `after`."""
    for line in log.splitlines():
        if re.search(pattern, line):
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if stamp >= after - 0.01:
                return stamp
    raise RuntimeError(f"no log line matching {pattern!r} after the kill")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--worker-timeout", default="2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="duoserve-restart-", suffix=".log")[1])
    command = [
        str(Path(sys.executable).parent / "duoserve"),
        *("serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"),
        *("--dtype", args.dtype, "--worker-timeout", args.worker_timeout, "--num-kv-blocks", "512"),
    ]
    print(f"# {' '.join(command)}  (log: {log_path})")
    with log_path.open("w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_ready(240)
            solo = client.generate(PROMPT, max_tokens=args.tokens, ignore_eos=True).token_ids
            print(
                f"  {'kill':>4} {'noticed s':>10} {'replacement ready s':>20} {'first resumed token s':>22} {'same tokens':>12}"
            )
            for repeat in range(args.repeats):
                worker = next(
                    p
                    for p in psutil.Process(server.pid).children(recursive=True)
                    if "worker" in " ".join(p.cmdline())
                )
                tokens: list[int] = []
                killed_wall = killed = 0.0
                resumed = None
                for chunk in client.stream(PROMPT, max_tokens=args.tokens, ignore_eos=True, timeout=600):
                    now = time.monotonic()
                    if killed and resumed is None and chunk.token_ids:
                        resumed = now - killed
                    tokens += chunk.token_ids
                    if len(tokens) >= 8 and not killed:
                        worker.send_signal(signal.SIGKILL)
                        killed, killed_wall = time.monotonic(), time.time()
                log_text = log_path.read_text()
                noticed = log_time(log_text, r"the worker was lost", killed_wall) - killed_wall
                ready = log_time(log_text, r"replacement worker ready", killed_wall) - killed_wall
                rows.append(
                    {"noticed_s": noticed, "ready_s": ready, "resumed_s": resumed, "same": tokens == solo}
                )
                print(
                    f"  {repeat + 1:>4} {noticed:>10.2f} {ready:>20.2f} {resumed or float('nan'):>22.2f} {tokens == solo!s:>12}"
                )
                client.wait_until_ready(60)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "kills": rows}, indent=2))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

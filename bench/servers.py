"""Launching `duoserve serve` for a benchmark, and reading what its worker did.

`launched_server` starts one server configuration (`ServerConfig`, e.g. "dtype=bfloat16,no-sbo")
on a free port, waits until its health says SERVING and stops it afterwards; `worker_seconds`
and `print_worker_split` read the worker's busy, wait and staging counters from /metrics, so a run
can say how the worker spent it. bench/serving.py and the other serving benchmarks share these.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from duoserve_client import Client, DuoserveError


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One server configuration: ``label`` as given, e.g. "dtype=bfloat16,max-num-seqs=32"."""

    label: str
    dtype: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> ServerConfig:
        """``key=value[,key=value...]``; keys are ``duoserve serve`` flags without the dashes; a
        key alone is a switch (``no-sbo``)."""
        values: dict[str, str | None] = {}
        for item in filter(None, text.split(",")):
            key, sep, value = item.partition("=")
            if not key.strip():
                raise argparse.ArgumentTypeError(
                    f"config {text!r}: expected key=value or a switch, got {item!r}"
                )
            values[key.strip().removeprefix("--")] = value.strip() if sep else None
        dtype = values.pop("dtype", None) or "auto"
        flags = []
        for key, setting in values.items():
            flags += [f"--{key}"] if setting is None else [f"--{key}", setting]
        return cls(label=text, dtype=dtype, flags=tuple(flags))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclasses.dataclass(frozen=True)
class LaunchedServer:
    target: str
    metrics_url: str | None
    pid: int  # `duoserve serve`, the parent of its scheduler and workers


def worker_memory_mb(server_pid: int) -> dict[str, float]:
    """Resident memory of the server's workers, now and at their peak (VmRSS, VmHWM), in MB."""
    found: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            status = (proc / "status").read_text()
        except (OSError, ValueError):
            continue  # not a process, or one that just exited
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent != server_pid or not title.startswith("duoserve: worker"):
            continue
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                name = "rss_mb" if key == "VmRSS" else "peak_rss_mb"
                found[name] = found.get(name, 0.0) + int(value.split()[0]) / 1024
    return found


@contextlib.contextmanager
def launched_server(
    config: ServerConfig, args: argparse.Namespace, log_dir: Path
) -> Iterator[LaunchedServer]:
    """Start ``duoserve serve`` with this config, wait for SERVING, yield it, then SIGTERM it."""
    duoserve = Path(sys.executable).parent / "duoserve"
    port = free_port()
    command = [str(duoserve), "serve", "--model", str(args.model), "--host", "127.0.0.1", "--port", str(port)]
    help_text = subprocess.run([str(duoserve), "serve", "--help"], capture_output=True, text=True).stdout
    metrics_url = None
    if "--metrics-port" in help_text:
        metrics_port = free_port()
        command += ["--metrics-port", str(metrics_port)]
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    command += ["--dtype", config.dtype, *config.flags, *shlex.split(args.server_args)]
    log_path = log_dir / f"server-{len(list(log_dir.glob('server-*.log')))}.log"
    print(f"# launching: {shlex.join(command)}  (log: {log_path})", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    target = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + args.startup_timeout
        with Client(target) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"server exited with {process.returncode}:\n{_log_tail(log_path)}")
                try:
                    client.wait_until_ready(min(2.0, max(0.1, deadline - time.monotonic())))
                    break
                except DuoserveError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"server not SERVING after {args.startup_timeout:g} s:\n{_log_tail(log_path)}"
                        ) from None
        yield LaunchedServer(target, metrics_url, process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


WORKER_COUNTERS = (
    "busy",
    "sampling",
    "wait",
    "staging",
    "exposed_staging",
    "exposed_staging_full",
    "decode_busy",
)


WORKER_STEP_COUNTERS = ("steps", "forecast_steps", "decode_steps")


def worker_seconds(metrics_url: str | None) -> dict[str, float]:
    """The server's duoserve_worker_*_seconds_total counters (empty without a metrics endpoint)."""
    if metrics_url is None:
        return {}
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for name in WORKER_COUNTERS:
        match = re.search(rf"^duoserve_worker_{name}_seconds_total (\S+)$", text, re.MULTILINE)
        if match:
            values[name] = float(match.group(1))
    for name in WORKER_STEP_COUNTERS:
        match = re.search(rf"^duoserve_worker_{name}_total (\S+)$", text, re.MULTILINE)
        if match:
            values[name] = float(match.group(1))
    return values


def print_worker_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How the worker spent one run: compute, idle waiting for the scheduler, staging (and its exposed part)."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    if {"busy", "wait"} <= delta.keys():
        idle = delta["wait"] / max(delta["wait"] + delta["busy"], 1e-9)
        exposed = delta.get("exposed_staging", 0.0) / max(delta.get("staging", 0.0), 1e-9)
        print(
            f"#   worker: busy {delta['busy']:.2f} s"
            + (f" (sampling {delta['sampling']:.2f} s of it)" if "sampling" in delta else "")
            + f", waited {delta['wait']:.2f} s (idle ratio {idle:.1%}), "
            f"staging {delta.get('staging', 0.0):.2f} s of which exposed {exposed:.1%}"
            + (
                f" ({delta['exposed_staging_full']:.3f} s of it in steps staged in full)"
                if "exposed_staging_full" in delta
                else ""
            )
            + (
                f", {delta['forecast_steps']:.0f} of {delta['steps']:.0f} steps forecast"
                if {"steps", "forecast_steps"} <= delta.keys()
                else ""
            ),
            flush=True,
        )
    split = step_kinds(delta)
    if split:
        print("#   worker steps: " + split, flush=True)
    return delta


def step_kinds(delta: dict[str, float]) -> str:
    """The run's decode steps (every sequence one token) and other steps (with prompt tokens): how
    many, and their mean compute time; empty where the server does not count decode steps."""
    if not {"busy", "steps", "decode_busy", "decode_steps"} <= delta.keys():
        return ""
    kinds = []
    for name, steps, busy in (
        ("decode", delta["decode_steps"], delta["decode_busy"]),
        ("with prompt tokens", delta["steps"] - delta["decode_steps"], delta["busy"] - delta["decode_busy"]),
    ):
        mean = f", {1000 * busy / steps:.1f} ms each" if steps > 0 else ""
        kinds.append(f"{steps:.0f} {name} ({busy:.2f} s{mean})")
    return ", ".join(kinds)


def triton_compiled_kernels() -> int:
    """Kernel variants in Triton's disk cache on this machine (TRITON_CACHE_DIR, else
    ~/.triton/cache): one metadata file each, beside the group files Triton also writes there."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return 0
    return sum(1 for path in root.glob("*/*.json") if not path.name.startswith("__grp__"))

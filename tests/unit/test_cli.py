"""Flags, their DUOSERVE_* environment variables, and validation that names the flag."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from scheduler.cli import SCHEDULER_FLAGS, WORKER_FLAGS, build_parser, main, scheduler_config, worker_config
from scheduler.config import ConfigError, SchedulerConfig
from scheduler.launcher import flags_to_argv
from scheduler.model_files import find_default_model
from scheduler.ports import addresses_in_use
from scheduler.server import run_scheduler


def parse(argv: list[str], env: dict[str, str] | None = None) -> object:
    return build_parser(env or {}).parse_args(argv)


def test_environment_sets_a_flag_and_the_command_line_wins() -> None:
    env = {"DUOSERVE_MAX_INFLIGHT": "4", "DUOSERVE_DTYPE": "float32", "DUOSERVE_SBO": "off"}
    args = parse(["serve", "--model", "m.gguf"], env)
    assert (args.max_inflight, args.dtype, args.sbo) == (4, "float32", False)
    args = parse(["serve", "--model", "m.gguf", "--max-inflight", "1", "--sbo"], env)
    assert (args.max_inflight, args.sbo) == (1, True)
    no_dbo = scheduler_config(parse(["scheduler", "--model", "m.gguf", "--no-dbo", "--max-inflight", "4"]))
    assert (no_dbo.dbo, no_dbo.max_inflight, no_dbo.lanes) == (False, 4, 1)
    assert scheduler_config(parse(["scheduler", "--model", "m.gguf", "--max-inflight", "4"])).lanes == 4


def test_bad_environment_value_names_the_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["scheduler"], {"DUOSERVE_PORT": "many"})
    assert "DUOSERVE_PORT" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_a_missing_model_is_a_usage_error_before_any_process_starts(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[object] = []
    monkeypatch.setattr("scheduler.launcher._spawn", lambda *args: spawned.append(args))
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", "/no/such/model.gguf"])
    assert exit_.value.code == 2 and spawned == []
    assert "--model '/no/such/model.gguf': no such file or directory" in capsys.readouterr().err


def test_a_model_file_the_scheduler_cannot_read_ends_it_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    truncated = tmp_path / "truncated.gguf"
    with find_default_model().open("rb") as model:
        truncated.write_bytes(model.read(100_000))
    config = scheduler_config(parse(["scheduler", "--model", str(truncated)]))
    assert run_scheduler(config) == 1
    assert f"cannot load the model's tokenizer: {truncated}: not a readable GGUF file" in caplog.text


def test_a_port_taken_on_one_of_the_hosts_addresses_ends_the_scheduler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """localhost is 127.0.0.1 and ::1: gRPC listens on whichever it can and calls that success, so
    with another program on 127.0.0.1's port clients would reach that program instead."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        assert addresses_in_use("localhost", port) == [f"127.0.0.1:{port}"]
        argv = ["scheduler", "--port", str(port), "--worker-address", f"ipc://{tmp_path}/w.sock"]
        assert run_scheduler(scheduler_config(parse(argv))) == 1
    assert f"cannot listen on localhost:{port}: 127.0.0.1:{port} in use" in caplog.text
    assert addresses_in_use("localhost", port) == [] and addresses_in_use("localhost", 0) == []


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_serve_stops_before_any_process_starts_on_a_port_another_server_holds(
    flag: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher announces "serving" once the port answers health checks: a server already
    there would answer them in its place while this one failed to bind."""
    spawned: list[object] = []
    monkeypatch.setattr("scheduler.launcher._spawn", lambda *args: spawned.append(args))
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["serve", flag, str(port)])
    assert exit_.value.code == 1 and spawned == []
    assert f"cannot serve on localhost:{port} ({flag}): 127.0.0.1:{port} in use" in caplog.text


def test_config_validation_names_the_flag_and_range() -> None:
    args = parse(["scheduler", "--model", "m.gguf", "--max-inflight", "9"])
    with pytest.raises(ConfigError, match=r"--max-inflight=9 is invalid: allowed 1\.\.4"):
        scheduler_config(args)
    with pytest.raises(ConfigError, match="--block-size"):
        SchedulerConfig(model="m", block_size=12, worker_address="ipc:///tmp/x")
    with pytest.raises(ConfigError, match=r"--stream-interval=0 is invalid: allowed 1\.\.256"):
        scheduler_config(parse(["scheduler", "--model", "m.gguf", "--stream-interval", "0"]))
    assert (
        scheduler_config(parse(["scheduler", "--model", "m.gguf", "--stream-interval", "8"])).stream_interval
        == 8
    )


def test_worker_config_checks_its_flags() -> None:
    args = parse(["worker", "--model", "m.gguf", "--scheduler-address", "tcp://127.0.0.1:5555"])
    config = worker_config(args)
    assert config.scheduler_address == "tcp://127.0.0.1:5555" and config.sbo and not config.sbo_threads
    off = worker_config(parse(["worker", "--model", "m", "--scheduler-address", "ipc:///x", "--no-sbo"]))
    assert not off.sbo
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        worker_config(
            parse(["worker", "--model", "m", "--scheduler-address", "ipc:///x", "--kv-cache-memory", "2"])
        )

    base = ["worker", "--model", "m", "--scheduler-address", "ipc:///x"]
    for flag, value in (
        ("--sbo-depth", "0"),
        ("--sbo-depth", "5"),
        ("--compute-streams", "0"),
        ("--compute-streams", "5"),
        ("--cuda-graph-max-batch", "0"),
        ("--sbo-switch-interval-ms", "0"),
        ("--sbo-switch-interval-ms", "101"),
        ("--cpu-vector-bits", "128"),
        ("--dense-weights", "some"),
        ("--omp-spin-count", "-1"),
    ):
        with pytest.raises(ValueError, match=flag):
            worker_config(parse([*base, flag, value]))
    assert worker_config(parse([*base, "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    for backend in ("cpu", "triton", "torch"):  # every backend reads an int8 cache
        int8 = worker_config(parse([*base, "--kv-cache-dtype", "int8", "--attention-backend", backend]))
        assert (int8.kv_cache_dtype, int8.attention_backend) == ("int8", backend)
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse([*base, "--kv-cache-dtype", "fp8"])
    tuned = worker_config(parse([*base, "--sbo-depth", "4", "--compute-streams", "2", "--no-cuda-graphs"]))
    assert (tuned.sbo_depth, tuned.compute_streams, tuned.cuda_graphs) == (4, 2, False)
    assert config.sbo_switch_interval_ms == 0.2
    assert worker_config(parse([*base, "--sbo-switch-interval-ms", "5"])).sbo_switch_interval_ms == 5.0
    assert config.cpu_vector_bits == 512
    assert worker_config(parse([*base, "--cpu-vector-bits", "256"])).cpu_vector_bits == 256
    assert config.omp_spin_count == 1000
    assert worker_config(parse([*base, "--omp-spin-count", "0"])).omp_spin_count == 0
    assert config.dense_weights == "auto"
    assert worker_config(parse([*base, "--dense-weights", "drop"])).dense_weights == "drop"
    with pytest.raises(ValueError, match=r"--dense-weights.*--no-block-linear"):
        worker_config(parse([*base, "--dense-weights", "drop", "--no-block-linear"]))


def test_serve_passes_every_flag_through_to_its_children() -> None:
    args = parse(
        [
            "serve",
            "--model",
            "m.gguf",
            "--no-sbo",
            "--block-size",
            "32",
            "--dtype",
            "bfloat16",
            "--compute-streams",
            "2",
            "--sbo-depth",
            "3",
            "--no-cuda-graphs",
            "--cpu-vector-bits",
            "0",
            "--dense-weights",
            "keep",
            "--omp-spin-count",
            "250",
        ]
    )
    scheduler = scheduler_config(args)
    worker = worker_config(args, scheduler_address=scheduler.worker_address)
    child = build_parser({}).parse_args(
        ["scheduler", "--model", "m.gguf", *flags_to_argv(SCHEDULER_FLAGS, scheduler)]
    )
    assert scheduler_config(child) == scheduler
    child_w = build_parser({}).parse_args(
        [
            "worker",
            "--model",
            "m.gguf",
            "--scheduler-address",
            scheduler.worker_address,
            *flags_to_argv(WORKER_FLAGS, worker),
        ]
    )
    assert worker_config(child_w) == worker


def test_every_flag_is_a_config_field() -> None:
    from dataclasses import fields

    from gpu_worker.config import WorkerConfig

    scheduler_fields = {f.name for f in fields(SchedulerConfig)}
    worker_fields = {f.name for f in fields(WorkerConfig)}
    assert {f.dest for f in SCHEDULER_FLAGS} <= scheduler_fields
    assert {f.dest for f in WORKER_FLAGS} <= worker_fields


def test_the_readme_names_every_flag_of_serve() -> None:
    """The README's flag tables are where users look first: a flag added without a row fails here."""
    from scheduler.cli import COMMON_FLAGS, TRACING_FLAGS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    flags = [f.name for group in (COMMON_FLAGS, TRACING_FLAGS, SCHEDULER_FLAGS, WORKER_FLAGS) for f in group]
    assert len(flags) > 40
    missing = [name for name in flags if not re.search(rf"{name}(?![\w-])", readme)]
    assert missing == [], f"README.md does not name {missing}"


def test_only_a_worker_started_from_its_own_command_line_sets_its_spin_count_and_restarts_for_huge_pages(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gpu_worker.host_memory
    import gpu_worker.thread_waits
    import gpu_worker.worker

    restarts: list[None] = []
    spin_counts: list[int] = []
    monkeypatch.setattr(gpu_worker.host_memory, "restart_with_huge_pages", lambda: restarts.append(None))
    monkeypatch.setattr(gpu_worker.thread_waits, "set_spin_count", spin_counts.append)
    monkeypatch.setattr(gpu_worker.worker, "run_worker", lambda config: 0)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    worker = ["worker", "--model", str(model), "--scheduler-address", "ipc:///tmp/duoserve-cli-test.sock"]
    # Called with an argv of its own (as a test or an embedding program would): restarting would run
    # this process's own command line, not that argv, and torch may be loaded already.
    with pytest.raises(SystemExit) as exit_code:
        main(worker)
    assert (exit_code.value.code, restarts, spin_counts) == (0, [], [])
    # Its own command line: the worker starts again with huge pages (unless --no-huge-pages), in an
    # environment that gives the OpenMP runtime its spin count.
    monkeypatch.setattr("sys.argv", ["duoserve", *worker])
    with pytest.raises(SystemExit):
        main()
    assert (restarts, spin_counts) == ([None], [1000])
    monkeypatch.setattr("sys.argv", ["duoserve", *worker, "--no-huge-pages", "--omp-spin-count", "0"])
    with pytest.raises(SystemExit):
        main()
    assert (restarts, spin_counts) == ([None], [1000, 0])

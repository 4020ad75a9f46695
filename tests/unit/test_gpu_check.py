"""`make gpu-check` (bench/gpu_check.sh) installs what it needs into the GPU machine's own Python:
the packages, with the bounds pyproject.toml gives them. It runs only on a machine with an
NVIDIA GPU; its list of requirements is checked here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def stated(table_key: str) -> list[str]:
    """The requirements of pyproject.toml's list `table_key` (dependencies, dev), one per line
    there (read as text: tomllib is not in Python 3.10, which the project supports)."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf"^{table_key} = \[(.*?)^\]", text, re.S | re.M)
    assert match, f"pyproject.toml has no {table_key} list"
    return re.findall(r'^\s*"([^"]+)"', match[1], re.M)


def test_gpu_check_installs_the_projects_dependencies_with_their_bounds() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--requirements"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    installed = done.stdout.split()
    bounds = {name_of(r): r for r in [*stated("dependencies"), *stated("dev")]}
    assert "grpcio" in bounds and "pytest" in bounds
    for requirement in installed:  # each as pyproject.toml bounds it, where it does
        assert requirement == bounds.get(name_of(requirement), requirement)
    # Everything duoserve runs on, but torch (the machine's own CUDA build is used as it is).
    runtime = {name_of(r) for r in stated("dependencies")} - {"torch"}
    assert runtime <= {name_of(r) for r in installed}
    assert "transformers>=4.45,<5.25" in installed  # the release after it breaks the parity tests


def test_every_server_config_and_test_path_it_names_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU machine is lent for minutes: a flag renamed or a test file moved since the script
    was written would fail there, not here. Each --configs entry must parse as `duoserve serve`
    flags, and each path handed to pytest must exist."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # bench/serving.py imports its neighbours
    from bench.serving import ServerConfig
    from scheduler.cli import build_parser

    script = (REPO / "bench" / "gpu_check.sh").read_text().replace("\\\n", " ")
    serving = re.search(r"bench/serving\.py (.*?)--json", script, re.S)
    assert serving, "gpu_check.sh runs no bench/serving.py"
    configs = re.findall(r'"(dtype=[^"]+)"', serving[1])
    assert len(configs) >= 5 and "dtype=bfloat16,no-sbo" in configs
    parser = build_parser({})
    for text in configs:
        config = ServerConfig.parse(text)
        args = parser.parse_args(["serve", "--dtype", config.dtype, *config.flags])
        assert args.command == "serve", text
    paths = re.findall(r"\b(tests/[\w/]+(?:\.py)?)", script)
    assert "tests/kernels" in paths and "tests/test_cuda_pipeline.py" in paths
    for path in paths:
        assert (REPO / path).exists(), path


def test_each_pytest_step_it_runs_collects_tests() -> None:
    """A step whose -k matches nothing would exit 5 on the GPU machine: each collects some here.
    The steps' collections run side by side, a core each."""
    import shlex
    import sys

    script = (REPO / "bench" / "gpu_check.sh").read_text()
    steps = re.findall(r'^run (tests-[\w-]+) \d+ "\$\{PYTEST\[@\]\}" (.+)$', script, re.M)
    assert {name for name, _ in steps} >= {"tests-kernels", "tests-gpu", "tests-e2e"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    collecting = {}
    for name, args in steps:
        args = re.sub(
            r'"\$\{\w+\[@\]\}"\s*', "", args
        )  # option arrays (pytest-xdist's -n) the machine may set
        collecting[name] = subprocess.Popen(
            [*command, "--collect-only", *shlex.split(args)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        for name, process in collecting.items():
            output, _ = process.communicate(timeout=120)
            collected = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
            assert process.returncode == 0 and collected and int(collected[1]) > 0, (name, output[-2000:])
    finally:
        for process in collecting.values():
            if process.poll() is None:
                process.kill()
                process.wait()

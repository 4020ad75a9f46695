"""`make gpu-check` (bench/gpu_check.sh) installs what it needs into the GPU machine's own Python:
the packages, with the bounds pyproject.toml gives them. It runs only on a machine with an
NVIDIA GPU; its list of requirements is checked here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()


def test_gpu_check_installs_the_projects_dependencies_with_their_bounds() -> None:
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), "--requirements"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    installed = done.stdout.split()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    stated = {name_of(r): r for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]}
    for requirement in installed:  # each as pyproject.toml bounds it, where it does
        assert requirement == stated.get(name_of(requirement), requirement)
    # Everything duoserve runs on, but torch (the machine's own CUDA build is used as it is).
    runtime = {name_of(r) for r in project["dependencies"]} - {"torch"}
    assert runtime <= {name_of(r) for r in installed}
    assert "transformers>=4.45,<5.25" in installed  # the release after it breaks the parity tests

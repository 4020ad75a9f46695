"""The wheel `pip install .` builds, as the Docker images install duoserve: its workers compile the
CPU kernels from the C sources at their first start, so the wheel must carry them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protos", "scheduler", "gpu_worker", "kernels")


def test_the_wheel_carries_every_module_the_kernel_sources_and_the_protos(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy, so that the build leaves the checkout as it is
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(source)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    # setuptools warns of a directory it would leave out of the packages it was given.
    assert "Package would be ignored" not in built.stdout + built.stderr
    (wheel,) = tmp_path.glob("duoserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*")
        if path.suffix in (".py", ".c", ".h", ".proto") and "__pycache__" not in path.parts
    }
    assert {"kernels/cpu/block_linear.c", "kernels/cpu/blocks.h", "protos/inference.proto"} <= expected
    assert sorted(expected - names) == []

"""The worker's OpenMP spin count (gpu_worker/thread_waits.py, `--omp-spin-count`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.thread_waits import set_spin_count, spin_environment, thread_waits_in_effect

DUOSERVE = str(Path(sys.executable).parent / "duoserve")


def test_the_spin_count_is_set_unless_the_environment_says_how_threads_wait() -> None:
    assert spin_environment({}, 1000) == {"GOMP_SPINCOUNT": "1000"}
    assert spin_environment({"PATH": "/bin"}, 0) == {"GOMP_SPINCOUNT": "0"}
    assert spin_environment({"GOMP_SPINCOUNT": "77"}, 1000) == {}
    assert spin_environment({"OMP_WAIT_POLICY": "active"}, 1000) == {}


def test_the_log_says_how_threads_wait() -> None:
    assert (
        thread_waits_in_effect({"GOMP_SPINCOUNT": "1000"}) == "spin 1000 times, then sleep (GOMP_SPINCOUNT)"
    )
    assert thread_waits_in_effect({"OMP_WAIT_POLICY": "passive"}) == "as OMP_WAIT_POLICY=passive says"
    assert (
        thread_waits_in_effect({"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "5"})
        == "as OMP_WAIT_POLICY=active says (GOMP_SPINCOUNT=5)"
    )
    assert thread_waits_in_effect({}) == "as the OpenMP runtime's defaults say"


def test_setting_it_after_torch_is_loaded_is_refused() -> None:
    import torch  # noqa: F401  (loads the OpenMP runtime, which has read its variables)

    environ: dict[str, str] = {}
    with pytest.raises(RuntimeError, match="before importing torch"):
        set_spin_count(1000, environ)
    assert environ == {}


@pytest.mark.parametrize(
    ("flags", "environment", "shown", "logged"),
    [
        ((), {}, "GOMP_SPINCOUNT = '1000'", "spin 1000 times, then sleep"),
        (("--omp-spin-count", "250"), {}, "GOMP_SPINCOUNT = '250'", "spin 250 times, then sleep"),
        (("--omp-spin-count", "250"), {"GOMP_SPINCOUNT": "77"}, "GOMP_SPINCOUNT = '77'", "spin 77 times"),
        ((), {"OMP_WAIT_POLICY": "active"}, "OMP_WAIT_POLICY = 'ACTIVE'", "as OMP_WAIT_POLICY=active says"),
    ],
    ids=["default", "flag", "GOMP_SPINCOUNT stands", "OMP_WAIT_POLICY stands"],
)
def test_a_worker_process_s_openmp_runtime_takes_the_spin_count(
    tmp_path: Path, flags: tuple[str, ...], environment: dict[str, str], shown: str, logged: str
) -> None:
    # The OpenMP runtime prints the settings it read when it loads (OMP_DISPLAY_ENV); then the
    # worker stops at the model, an empty file, before it would look for a scheduler.
    model = tmp_path / "empty.gguf"
    model.touch()
    inherited = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run(
        [DUOSERVE, "worker", "--model", str(model), "--scheduler-address", f"ipc://{tmp_path}/s", *flags],
        env={**inherited, "OMP_DISPLAY_ENV": "verbose", **environment},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3, run.stderr[-2000:]  # CANNOT_START: the model
    assert shown in run.stderr, run.stderr[-2000:]
    assert f"idle OpenMP threads: {logged}" in run.stderr

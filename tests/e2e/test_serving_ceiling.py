"""bench/serving_ceiling.py: the real scheduler, gRPC and SDK with a worker that answers at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving_ceiling.py"


def ceiling_run(tmp_path: Path, device: str, serving_args: str) -> tuple[str, list[dict[str, Any]]]:
    """bench/serving_ceiling.py with bench/serving.py's `serving_args`: its output and its runs."""
    out = tmp_path / "ceiling.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--device", device, "--serving-args", f"{serving_args} --json {out}"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runs: list[dict[str, Any]] = json.loads(out.read_text())["runs"]
    return run.stdout, runs


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_ceiling_run_serves_every_request_through_the_real_scheduler(tmp_path: Path, device: str) -> None:
    stdout, (result,) = ceiling_run(tmp_path, device, "--quick --workloads random")
    assert (result["completed"], result["errors"]) == (8, 0)
    assert result["output_tokens"] == 8 * 16  # --quick: 8 requests of 16 tokens, ignore_eos
    answered = [line for line in stdout.splitlines() if line.startswith("# instant worker: answered")]
    assert answered and int(answered[0].split()[4]) >= 16, answered


def test_a_unary_run_serves_each_request_in_one_response_without_latencies(tmp_path: Path) -> None:
    _, (streamed, unary) = ceiling_run(tmp_path, "cpu", "--quick --workloads random --unary")
    assert (streamed["mode"], unary["mode"]) == ("offline", "offline-unary")
    for result in (streamed, unary):
        assert (result["completed"], result["errors"], result["output_tokens"]) == (8, 0, 8 * 16)
        assert result["output_tok_s"] > 0 and result["e2e_p50"] > 0
    assert streamed["ttft_p50"] is not None and streamed["tpot_p50"] is not None
    # A unary response brings every token at once: no first token to time, no time between tokens.
    assert unary["ttft_p50"] is None and unary["tpot_p50"] is None

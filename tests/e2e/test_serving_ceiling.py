"""bench/serving_ceiling.py: the real scheduler, gRPC and SDK with a worker that answers at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serving_ceiling.py"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_ceiling_run_serves_every_request_through_the_real_scheduler(tmp_path: Path, device: str) -> None:
    out = tmp_path / "ceiling.json"
    serving = f"--quick --workloads random --json {out}"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--device", device, "--serving-args", serving],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (result,) = json.loads(out.read_text())["runs"]
    assert (result["completed"], result["errors"]) == (8, 0)
    assert result["output_tokens"] == 8 * 16  # --quick: 8 requests of 16 tokens, ignore_eos
    answered = [line for line in run.stdout.splitlines() if line.startswith("# instant worker: answered")]
    assert answered and int(answered[0].split()[4]) >= 16, answered

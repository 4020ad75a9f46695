"""The short version of bench/soak.py: concurrent clients, cancellations, deadlines and a killed worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_worker.worker import HEARTBEAT_INTERVAL_S

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--clients",
            "4",
            "--requests",
            "4",
            "--json",
            str(report_path),
            "--log",
            str(tmp_path / "server.log"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["failures"] == []
    assert sum(report["outcomes"].values()) == 16  # every request accounted for
    assert report["outcomes"].get("completed", 0) > 0
    # The scheduler learns of the killed worker whichever way comes first: its heartbeats stop for
    # --worker-timeout 2 s (counted from the last one, up to an interval before the kill), or the
    # replacement that `serve` starts says Hello in its place, which on a fast machine it can do
    # sooner (seen: 1.45 s after the kill).
    lost = (tmp_path / "server.log").read_text()
    if "connected in its place" in lost:
        assert 0.0 < report["noticed_s"] < 6.0
    else:
        assert "the worker was lost: no heartbeat" in lost
        assert 2.0 - HEARTBEAT_INTERVAL_S <= report["noticed_s"] < 6.0
    assert report["outage_s"] > report["noticed_s"]

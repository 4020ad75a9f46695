"""The short version of bench/soak.py: concurrent clients, cancellations, deadlines and a killed worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert 1.5 < report["noticed_s"] < 6.0  # --worker-timeout 2
    assert report["outage_s"] > report["noticed_s"]

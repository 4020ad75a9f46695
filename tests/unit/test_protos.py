"""The generated modules match the .proto files (python -m protos.generate rewrites them)."""

from __future__ import annotations

import re

from protos import worker_pb2
from protos.generate import CLIENT_PROTO_DIR, PROTO_DIR, ROOT, stale_files
from protos.running import RunningEntry, pack_running, unpack_running


def test_generated_modules_are_up_to_date() -> None:
    assert stale_files() == [], "run `python -m protos.generate`; never edit generated modules by hand"


def _requirements(pyproject: str) -> dict[str, str]:
    """The quoted requirement strings of a pyproject.toml, by package name."""
    specs = re.findall(r'"([A-Za-z0-9_.-]+(?:[<>=!~]=?)[^"]*)"', (ROOT / pyproject).read_text())
    return {re.split(r"[<>=!~]", spec)[0]: spec for spec in specs}


def test_the_declared_runtimes_are_those_the_generated_modules_accept() -> None:
    """A generated module raises at import under an older grpcio or protobuf than its generator's,
    so the declared floors are the generator's versions, and the generator is pinned."""
    declared = {
        pyproject: _requirements(pyproject)
        for pyproject in ("pyproject.toml", "clients/python/pyproject.toml")
    }
    for folder in (PROTO_DIR, CLIENT_PROTO_DIR):
        grpc_module = (folder / "inference_pb2_grpc.py").read_text()
        grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_module)
        pb2_module = (folder / "inference_pb2.py").read_text()
        pb2_version = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2_module)
        assert grpc_version is not None and pb2_version is not None
        major = pb2_version.group(1)
        protobuf = f"protobuf>={'.'.join(pb2_version.groups())},<{int(major) + 1}"
        for pyproject, requirements in declared.items():
            assert requirements["grpcio"] == f"grpcio>={grpc_version.group(1)}", pyproject
            assert requirements["protobuf"] == protobuf, pyproject
        assert declared["pyproject.toml"]["grpcio-tools"] == f"grpcio-tools=={grpc_version.group(1)}"


def test_running_sequences_pack_and_unpack_to_the_same_entries() -> None:
    entries = [
        RunningEntry(7, 40, 1, [12]),
        RunningEntry(2**40 + 3, 17, 32),
        RunningEntry(9, 0, 1, [5, 6, 8]),
    ]
    message = worker_pb2.RunningSequences.FromString(pack_running(entries).SerializeToString())
    running = unpack_running(message)
    assert len(running) == 3
    assert running.seq_ids.tolist() == [7, 2**40 + 3, 9]
    assert running.num_computed_tokens.tolist() == [40, 17, 0]
    assert running.num_new_tokens.tolist() == [1, 32, 1]
    assert running.blocks_of() == [[12], [], [5, 6, 8]]
    assert len(unpack_running(pack_running([]))) == 0

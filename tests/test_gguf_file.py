"""scheduler/gguf_file.py reads what the `gguf` package's own reader reads, and refuses broken files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from scheduler.gguf_file import GGUFFormatError, read_gguf
from scheduler.model_files import find_default_model


def assert_same_as_gguf_reader(path: Path) -> None:
    theirs = gguf.GGUFReader(path)
    ours = read_gguf(path)
    # The package's reader adds three entries of its own for the header.
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert set(ours.fields) == set(theirs.fields) - header
    for name, field in theirs.fields.items():
        if name not in header:
            assert ours.fields[name] == field.contents(), name
            assert (name in ours.array_types) == (field.types[0] == gguf.GGUFValueType.ARRAY), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in other.shape), mine.name
        assert mine.tensor_type == other.tensor_type, mine.name
        assert np.array_equal(
            np.asarray(mine.data).reshape(-1).view(np.uint8),
            np.asarray(other.data).reshape(-1).view(np.uint8),
        ), mine.name
    # Passing over the arrays (as the worker reads its model) keeps everything else.
    passed = read_gguf(path, arrays=False)
    assert passed.fields == {
        name: value for name, value in ours.fields.items() if name not in ours.array_types
    }
    assert passed.array_types == ours.array_types
    assert (
        passed.array_lengths
        == ours.array_lengths
        == {name: len(ours.fields[name]) for name in ours.array_types}
    )
    assert [(t.name, t.shape, t.tensor_type) for t in passed.tensors] == [
        (t.name, t.shape, t.tensor_type) for t in ours.tensors
    ]


def write_small_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -5)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "héllo")
    writer.add_array("test.ints", [3, 1, 2])
    writer.add_array("test.words", ["a", "", "ünï"])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32))
    quantized = gguf.quants.quantize(
        np.linspace(-2, 2, 64 * 3, dtype=np.float32).reshape(3, 64), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_default_model_reads_as_the_gguf_package_reads_it() -> None:
    assert_same_as_gguf_reader(find_default_model())


def test_every_value_type_and_tensor_kind_of_a_small_file(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    assert_same_as_gguf_reader(path)
    read = read_gguf(path)
    assert read.fields["test.text"] == "héllo" and read.fields["test.words"] == ["a", "", "ünï"]
    assert read.fields["test.flag"] is True and read.fields["test.i64"] == -5
    f32, f16, q8 = read.tensors
    assert f32.shape == (4, 3) and f32.data.tolist() == list(range(12))
    assert f16.data.dtype == np.float16 and f16.data.size == 64
    assert q8.data.shape == (3, 2 * 34)  # per row: two blocks of 32 values, each 2 + 32 bytes
    values = gguf.quants.dequantize(q8.data, q8.tensor_type)
    assert np.allclose(values, np.linspace(-2, 2, 64 * 3).reshape(3, 64), atol=0.02)


def test_broken_files_are_refused_with_what_is_wrong(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_small_gguf(good)
    data = good.read_bytes()
    cases = {
        "no GGUF magic": b"GGML" + data[4:],
        "version 9 is unsupported": data[:4] + (9).to_bytes(4, "little") + data[8:],
        "truncated": data[:40],
        "runs past the end of the file": data[:-100],  # into the last tensor (q8, 204 bytes)
    }
    # Inside the last string of an array: its length says 5 bytes, 2 are left.
    cases[r"truncated: an? (string of 5 bytes|array of 3 strings) at byte \d+ runs past"] = data[
        : data.index("ünï".encode()) + 2
    ]
    for message, content in cases.items():
        path = tmp_path / "broken.gguf"
        path.write_bytes(content)
        for arrays in (True, False):
            with pytest.raises(GGUFFormatError, match=message):
                read_gguf(path, arrays=arrays)

"""Reading a GGUF file: its metadata and where each tensor's bytes are.

Both processes read the model's GGUF at start, the scheduler for its tokenizer and the worker
for its configuration and weights. `gguf.GGUFReader` maps every metadata value to a numpy view
of its own, which for SmolLM2's 49k-token vocabulary and 49k merges took 8-11 s of each start on
a 2-core machine; this reader decodes the same layout with `struct` in well under a second.
The `gguf` package still supplies the type codes and block sizes, and dequantizes the tensors.

Layout (GGUF v2 and v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a value type u32 and the value (strings are a u64
length and UTF-8 bytes, arrays an item type u32, a u64 count and the items); each tensor a
string name, a dimension count u32, the dimensions u64 (fastest first), a type u32 and an
offset u64 into the data section, which starts at the next multiple of `general.alignment`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_SCALARS: dict[int, struct.Struct] = {
    gguf.GGUFValueType.UINT8: struct.Struct("<B"),
    gguf.GGUFValueType.INT8: struct.Struct("<b"),
    gguf.GGUFValueType.UINT16: struct.Struct("<H"),
    gguf.GGUFValueType.INT16: struct.Struct("<h"),
    gguf.GGUFValueType.UINT32: struct.Struct("<I"),
    gguf.GGUFValueType.INT32: struct.Struct("<i"),
    gguf.GGUFValueType.FLOAT32: struct.Struct("<f"),
    gguf.GGUFValueType.BOOL: struct.Struct("<?"),
    gguf.GGUFValueType.UINT64: struct.Struct("<Q"),
    gguf.GGUFValueType.INT64: struct.Struct("<q"),
    gguf.GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, version, type or length)."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: fastest-varying dimension first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # the stored bytes: [rows, bytes per row] uint8, or the elements (F32, F16)


@dataclass(frozen=True, slots=True)
class GGUFFile:
    version: int
    fields: dict[str, Any]  # metadata by key: int, float, bool, str, or a list of them (if read)
    array_types: dict[str, gguf.GGUFValueType]  # item type of each array-valued key
    array_lengths: dict[str, int]  # item count of each array-valued key
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer = buffer
        self.offset = 0
        self.path = path

    def take(self, fmt: struct.Struct) -> Any:
        if self.offset + fmt.size > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: truncated at byte {self.offset}")
        (value,) = fmt.unpack_from(self.buffer, self.offset)
        self.offset += fmt.size
        return value

    def string(self) -> str:
        length = self.take(_U64)
        end = self.offset + length
        if end > len(self.buffer):
            raise GGUFFormatError(
                f"{self.path}: truncated: a string of {length} bytes at byte {self.offset} runs past the end"
            )
        text = bytes(self.buffer[self.offset : end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {kind} at byte {self.offset}")
        return self.take(fmt)

    def skip_strings(self, count: int) -> None:
        """Pass over `count` strings without decoding them (one length read each)."""
        buffer, offset, length_at = self.buffer, self.offset, _U64.unpack_from
        try:
            for _ in range(count):
                offset += 8 + length_at(buffer, offset)[0]
        except struct.error:
            offset = len(buffer) + 1
        if offset > len(buffer):
            raise GGUFFormatError(
                f"{self.path}: truncated: an array of {count} strings at byte {self.offset} runs past the end"
            )
        self.offset = offset

    def array(self, read: bool) -> tuple[gguf.GGUFValueType, int, list[Any] | None]:
        """An array's item type, count and items (None unless `read`: the cursor only passes them)."""
        kind, count = self.take(_U32), self.take(_U64)
        if kind == gguf.GGUFValueType.STRING:
            if read:
                return gguf.GGUFValueType.STRING, count, [self.string() for _ in range(count)]
            self.skip_strings(count)
            return gguf.GGUFValueType.STRING, count, None
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"{self.path}: unknown array item type {kind} at byte {self.offset}")
        size = fmt.size * count
        if self.offset + size > len(self.buffer):
            raise GGUFFormatError(
                f"{self.path}: truncated: an array of {count} items at byte {self.offset} runs past the end"
            )
        items = None
        if read:
            items = [item for (item,) in fmt.iter_unpack(self.buffer[self.offset : self.offset + size])]
        self.offset += size
        return gguf.GGUFValueType(kind), count, items


def read_gguf(path: str | Path, arrays: bool = True) -> GGUFFile:
    """Parse `path`'s metadata and tensor table; tensor data stays memory-mapped until read.
    Without `arrays`, array-valued keys (a tokenizer's vocabulary and merges) are passed over:
    they are left out of `fields`, and only their types and lengths are kept.

    Raises GGUFFormatError (a ValueError) for anything that is not a well-formed GGUF v2/v3 file,
    and OSError when the file cannot be read."""
    path = Path(path)
    # A plain ndarray over the mapping: slices of a np.memmap cost a Python call each.
    mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    cursor = _Cursor(mapped.data, path)
    if len(mapped) < 24 or bytes(mapped[:4]) != b"GGUF":
        raise GGUFFormatError(f"{path}: no GGUF magic at the start")
    cursor.offset = 4
    version = cursor.take(_U32)
    if version not in (2, 3):
        raise GGUFFormatError(f"{path}: GGUF version {version} is unsupported (2 and 3 are)")
    num_tensors, num_fields = cursor.take(_U64), cursor.take(_U64)
    fields: dict[str, Any] = {}
    array_types: dict[str, gguf.GGUFValueType] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(num_fields):
        key = cursor.string()
        kind = cursor.take(_U32)
        if kind == gguf.GGUFValueType.ARRAY:
            array_types[key], array_lengths[key], items = cursor.array(arrays)
            if items is not None:
                fields[key] = items
        else:
            fields[key] = cursor.value(kind)
    table = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.take(_U32)
        shape = tuple(cursor.take(_U64) for _ in range(num_dims))
        kind, offset = cursor.take(_U32), cursor.take(_U64)
        try:
            tensor_type = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"{path}: tensor {name!r} has unknown type {kind}") from None
        table.append((name, shape, tensor_type, offset))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFFormatError(f"{path}: general.alignment is {alignment!r}")
    start = -(-cursor.offset // alignment) * alignment
    tensors = [_tensor(path, mapped, start, *entry) for entry in table]
    return GGUFFile(version, fields, array_types, array_lengths, tensors)


def _tensor(
    path: Path,
    mapped: np.ndarray,
    start: int,
    name: str,
    shape: tuple[int, ...],
    tensor_type: gguf.GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    row = shape[0] if shape else 1
    rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    if row % block_size:
        raise GGUFFormatError(f"{path}: tensor {name!r} rows of {row} are not in blocks of {block_size}")
    row_bytes = row // block_size * type_size
    begin = start + offset
    end = begin + rows * row_bytes
    if end > len(mapped):
        raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
    raw = mapped[begin:end]
    plain = {
        gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F16: np.float16,
    }.get(tensor_type)
    data = raw.view(plain) if plain is not None else raw.reshape(rows, row_bytes)
    return GGUFTensor(name, shape, tensor_type, data)

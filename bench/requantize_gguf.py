"""Write a copy of a llama GGUF file with its layers' 2-D weights in another block type.

    .venv/bin/python bench/requantize_gguf.py OUT.gguf [--type Q5_0] [--model IN.gguf]

Every metadata key and every other tensor (norms, the embedding) is copied as stored; each
`blk.N.*.weight` matrix is dequantized by the gguf package and quantized again to `--type`
(Q8_0, Q5_0, Q5_1, Q4_0 or Q4_1: the types the gguf package can quantize). Small models' "K-quant"
files are mostly such blocks: llama.cpp's quantizer falls back from Q4_K/Q5_K/Q6_K to
Q5_0/Q5_1/Q8_0 for rows that are not a multiple of 256 long, SmolLM2-135M's 576 among them.
Benchmarks and tests serve the copy to compare block types on the same model.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.model_files import find_default_model

TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
LAYER_MATRIX = re.compile(r"blk\.\d+\.\w+\.weight")


def requantize(source: Path, target: Path, type_name: str) -> None:
    """`source` with its layer matrices in `type_name`, written to `target`."""
    quant = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None, f"{source}: no {gguf.Keys.General.ARCHITECTURE}"
    writer = gguf.GGUFWriter(target, arch=str(arch.contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue  # the header's own counts, and the key the writer adds itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        if LAYER_MATRIX.fullmatch(tensor.name) and len(tensor.shape) == 2:
            dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            blocks = gguf.quants.quantize(np.ascontiguousarray(dense, dtype=np.float32), quant)
            writer.add_tensor(tensor.name, blocks, raw_dtype=quant)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", choices=TYPES, default="Q5_0", help="block type of the layer matrices")
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file to copy (default: SmolLM2's)")
    args = parser.parse_args()
    requantize(args.model or find_default_model(), args.out, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, layer matrices in {args.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

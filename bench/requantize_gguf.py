"""Write a copy of a llama GGUF file with its layers' 2-D weights in another block type.

    .venv/bin/python bench/requantize_gguf.py OUT.gguf [--type Q5_0] [--model IN.gguf]

Every metadata key and every other tensor (norms, the embedding) is copied as stored; each
`blk.N.*.weight` matrix is dequantized by the gguf package and quantized again to `--type`:
- Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, TQ1_0, TQ2_0 and MXFP4 by the gguf package;
- Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, the codebook types (IQ1_S, IQ1_M, IQ2_XXS,
  IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and NVFP4 by bench/k_quants.py (the gguf package reads them but
  cannot write them). A super-block holds 256 weights; like llama.cpp's quantizer, rows of another
  length (SmolLM2-135M's 576) fall back: Q4_K, Q5_K and Q6_K to Q5_0, Q5_1 and Q8_0, Q2_K, Q3_K,
  IQ4_XS and the codebook types to IQ4_NL, TQ1_0 and TQ2_0 to Q4_0. So a small model's
  "K-quant" file is mostly such blocks; SmolLM2's ffn_down rows (1536) are the super-block ones.
  The ternary types make no sense of a model not trained for them: their files are for speed and
  memory, not for text.
- Q4_K_M, the mix llama.cpp names so: Q4_K, with attn_v and ffn_down in Q6_K in the layers it
  gives more bits (the first and last eighth of the layers, and every third one between).
- Q3_K_M, likewise: Q3_K, with attn_output in Q4_K, attn_v in Q5_K in the first two layers and
  Q4_K after, ffn_down in Q5_K in the first sixteenth of the layers and Q4_K after.
Benchmarks and tests serve the copy to compare block types on the same model.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import k_quants
from scheduler.model_files import find_default_model

TYPES = (
    *("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"),
    *("IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S", "IQ1_M"),
    *("TQ1_0", "TQ2_0", "MXFP4", "NVFP4"),
    *("Q4_K_M", "Q3_K_M"),
)
# for rows not in 256s
FALLBACK = {
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "Q2_K": "IQ4_NL",
    "Q3_K": "IQ4_NL",
    "IQ4_XS": "IQ4_NL",
    "IQ3_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL",
    "IQ2_S": "IQ4_NL",
    "IQ2_XS": "IQ4_NL",
    "IQ2_XXS": "IQ4_NL",
    "IQ1_S": "IQ4_NL",
    "IQ1_M": "IQ4_NL",
    "TQ1_0": "Q4_0",
    "TQ2_0": "Q4_0",
}
LAYER_MATRIX = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def matrix_type(type_name: str, kind: str, layer: int, layers: int, k: int) -> str:
    """The block type of layer `layer`'s `kind` matrix (attn_q, ffn_down, ...) with rows of k weights."""
    if type_name == "Q4_K_M":
        more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        type_name = "Q6_K" if kind in ("attn_v", "ffn_down") and more_bits else "Q4_K"
    elif type_name == "Q3_K_M":
        first = {"attn_v": 2, "ffn_down": layers // 16}.get(kind, 0)  # the layers given Q5_K
        more = kind in ("attn_v", "ffn_down", "attn_output")
        type_name = "Q5_K" if layer < first else "Q4_K" if more else "Q3_K"
    if type_name in FALLBACK and k % k_quants.SUPER:
        return FALLBACK[type_name]
    return type_name


def requantize(
    source: Path,
    target: Path,
    type_name: str,
    choose: Callable[[str, int, int, int], str | None] | None = None,
) -> dict[str, int]:
    """`source` with its layer matrices in `type_name`, written to `target`; the count of layer
    matrices written in each type. `choose(kind, layer, layers, k)`, where given, picks each
    matrix's type instead (None: the matrix as stored)."""
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    assert arch is not None, f"{source}: no {gguf.Keys.General.ARCHITECTURE}"
    writer = gguf.GGUFWriter(target, arch=str(arch.contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == gguf.Keys.General.ARCHITECTURE:
            continue  # the header's own counts, and the key the writer adds itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    layers = 1 + max((int(m[1]) for t in reader.tensors if (m := LAYER_MATRIX.fullmatch(t.name))), default=0)
    pick = choose or functools.partial(matrix_type, type_name)
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        matrix = LAYER_MATRIX.fullmatch(tensor.name)
        chosen = None
        if matrix and len(tensor.shape) == 2:
            chosen = pick(matrix[2], int(matrix[1]), layers, int(tensor.shape[0]))  # shape[0]: k
        if chosen is None:  # not a layer matrix, or one kept as stored
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        dense = np.ascontiguousarray(
            gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32
        )
        counts[chosen] = counts.get(chosen, 0) + 1
        writer.add_tensor(
            tensor.name, k_quants.write_blocks(dense, chosen), raw_dtype=gguf.GGMLQuantizationType[chosen]
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", choices=TYPES, default="Q5_0", help="block type of the layer matrices")
    parser.add_argument("--model", type=Path, default=None, help="the GGUF file to copy (default: SmolLM2's)")
    args = parser.parse_args()
    counts = requantize(args.model or find_default_model(), args.out, args.type)
    written = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB; layer matrices: {written})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

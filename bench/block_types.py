"""The block kernel on each GGUF block type, side by side, on the linears of one decoder layer of a
1B-class Llama (hidden 2048, 32 query and 8 KV heads of 64, ffn 8192: rows 256 long, so that
the super-block types apply), against oneDNN's packed float32 kernel on the same weights.

    .venv/bin/python bench/block_types.py [--rows 1 4 16 256] [--layers 2] [--types Q4_0 IQ2_XS ...]

Each type's weights are random, quantized by the gguf package (the K-quants, IQ4 types and NVFP4 by
bench/k_quants.py); the codebook types' (IQ1_S to IQ3_S) are random blocks of theirs.
`--layers` copies of the layer are streamed in turn, so that a pass does not find the last one's
weights in cache; the types take turns, medians of 7 passes. It prints milliseconds per layer,
and for the decode-sized rows the bytes streamed per second.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import k_quants
from gpu_worker.linear import Linear, block_kernel, packed_linear_available
from kernels.block_weights import BlockWeight

HIDDEN, KV, FFN = 2048, 512, 8192
SHAPES = {
    "qkv": (HIDDEN + 2 * KV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * FFN, HIDDEN),
    "down": (HIDDEN, FFN),
}
TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_XS", "IQ4_NL", "Q3_K", "Q2_K"]
# Random blocks: writing the codebook types' blocks for a 1B-class layer (a search over their
# codebooks) would take minutes.
TYPES += ["IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"]
TYPES += ["MXFP4", "NVFP4", "TQ2_0", "TQ1_0"]


def quantized(type_name: str, dense: np.ndarray) -> BlockWeight:
    if type_name in k_quants.CODEBOOK_BYTES:
        rng = np.random.default_rng(dense.shape[0])
        blocks = k_quants.random_codebook_blocks(type_name, *dense.shape, rng)
    else:
        blocks = k_quants.write_blocks(dense, type_name)
    return BlockWeight(int(gguf.GGMLQuantizationType[type_name]), torch.from_numpy(blocks), dense.shape[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 256])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument(
        "--types", nargs="+", default=TYPES, choices=TYPES, help="block types to run (default: all)"
    )
    args = parser.parse_args()
    kernel = block_kernel()
    if kernel is None:
        sys.exit("no block kernel on this CPU (it needs AVX2, FMA and F16C)")
    rng = np.random.default_rng(0)
    dense = {
        name: rng.standard_normal(shape, dtype=np.float32) / shape[1] ** 0.5 for name, shape in SHAPES.items()
    }
    # Per config, `--layers` copies of the layer: each linear as (its input size, its bytes, the call).
    configs: dict[str, list[list[tuple[int, int, Callable[[torch.Tensor], object]]]]] = {}
    started = time.perf_counter()
    for type_name in args.types:
        weights = [quantized(type_name, weight) for weight in dense.values()]
        configs[type_name] = [
            [
                (w.k, w.nbytes, partial(kernel, weight=BlockWeight(w.type, w.blocks.clone(), w.k)))
                for w in weights
            ]
            for _ in range(args.layers)
        ]
    if packed_linear_available(torch.float32, torch.device("cpu")):
        configs["oneDNN f32"] = [
            [
                (w.shape[1], w.size * 4, Linear(torch.from_numpy(w).clone(), None, packed=True))
                for w in dense.values()
            ]
            for _ in range(args.layers)
        ]
    print(f"# weights quantized in {time.perf_counter() - started:.1f} s; {torch.get_num_threads()} threads")
    inputs = {
        rows: {k: torch.randn(rows, k) for k in {shape[1] for shape in SHAPES.values()}} for rows in args.rows
    }
    times: dict[str, dict[int, list[float]]] = {name: {rows: [] for rows in args.rows} for name in configs}
    for _ in range(args.passes):
        for rows in args.rows:
            for name, layers in configs.items():
                for layer in layers:
                    began = time.perf_counter()
                    for k, _, call in layer:
                        call(inputs[rows][k])
                    times[name][rows].append(time.perf_counter() - began)
    print(
        f"{'type':>11} {'MB/layer':>9}"
        + "".join(f" {f'{rows} rows ms':>13}" for rows in args.rows)
        + "  GB/s at 1 row"
    )
    for name, layers in configs.items():
        layer_bytes = sum(nbytes for _, nbytes, _ in layers[0])
        medians = {rows: statistics.median(times[name][rows]) for rows in args.rows}
        rate = f"  {layer_bytes / medians[1] / 1e9:>13.1f}" if 1 in medians else ""
        print(
            f"{name:>11} {layer_bytes / 1e6:>9.1f}"
            + "".join(f" {1000 * medians[rows]:>13.2f}" for rows in args.rows)
            + rate
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

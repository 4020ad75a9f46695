"""A/B/C/D of SmolLM2's float32 linears (30 layers and the LM head), as a decode step runs them:
`F.linear`, oneDNN's packed kernel (which the worker takes in float32 where it runs), the
block kernel on the GGUF file's own Q4_1/Q8_0 blocks (which the worker takes for steps of up
to BLOCK_MAX_ROWS rows; gpu_worker/linear.py), and the block kernel on the weights rounded to
bfloat16 as BF16 blocks (what float32 serving of a bfloat16 checkpoint streams).

    .venv/bin/python bench/linear_ab.py [--rows 1 2 4 8 16 64 256]

With `--dtype bfloat16`, on a CPU that multiplies bfloat16 (AVX-512 BF16 or AMX): oneDNN's packed
bfloat16 kernel, the pair-layout kernel (kernels/cpu_pair_linear.py, which the worker takes there
for steps of up to 64 rows) and the block kernel's bfloat16 entry on the GGUF blocks (what the
worker takes on CPUs without them, and for steps of 1-2 rows on CPUs with AVX-512 BF16 but no
AMX, where its dot products beat the pair-layout kernel there).

Each pass streams every weight once, as a decode step does; the paths take turns, medians of 5.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_worker.linear import PACKING_BATCH_HINT, Linear, block_kernel, cpu_multiplies_bfloat16, pair_kernel
from gpu_worker.loader import load_block_weights, load_model
from gpu_worker.model import LlamaModel
from kernels import cpu_pair_linear
from kernels.block_weights import BlockWeight
from scheduler.model_files import find_default_model


def one_pass(
    all_linears: list[Linear],
    rows: int,
    run: Callable[[Linear, torch.Tensor], object],
    dtype: torch.dtype = torch.float32,
) -> float:
    sizes = {lin.weight.shape[1] for lin in all_linears}
    inputs = {size: torch.randn(rows, size).to(dtype) for size in sizes}
    started = time.perf_counter()
    for lin in all_linears:
        run(lin, inputs[lin.weight.shape[1]])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = find_default_model()
    config, weights = load_model(path)
    model = LlamaModel(config, torch.float32, "cpu")
    model.load_weights(weights, load_block_weights(path, config))
    all_linears = model.linears()
    if args.dtype == "bfloat16":
        bfloat16(all_linears, args.rows)
        return
    if not all(lin.packed for lin in all_linears):
        sys.exit("oneDNN's packed float32 linear does not run here: nothing to compare")
    kernel = block_kernel()
    with_blocks = kernel is not None and all(lin.blocks is not None for lin in all_linears)
    if with_blocks:
        mb = sum(lin.blocks.nbytes for lin in all_linears if lin.blocks is not None) / 1e6
        dense = sum(lin.weight.numel() * 4 for lin in all_linears) / 1e6
        print(f"weights: float32 {dense:.0f} MB, GGUF blocks {mb:.0f} MB, BF16 blocks {dense / 2:.0f} MB")
    else:
        print("no block kernel here (or a model without GGUF blocks): two columns only")

    runs: dict[str, Callable[[Linear, torch.Tensor], object]] = {
        "F.linear": lambda lin, x: F.linear(x, lin.weight, lin.bias),
        "oneDNN packed": lambda lin, x: lin._onednn(x),
    }
    if with_blocks:
        assert kernel is not None
        runs["blocks"] = lambda lin, x: kernel(x, lin.blocks)
        bf16 = {id(lin): BlockWeight.dense(lin.weight.bfloat16()) for lin in all_linears}
        runs["BF16 blocks"] = lambda lin, x: kernel(x, bf16[id(lin)])
    for rows in args.rows:
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(5):
            for name, run in runs.items():
                times[name].append(one_pass(all_linears, rows, run))
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = ", ".join(f"{name} {m * 1e3:7.1f} ms" for name, m in medians.items())
        ratios = ", ".join(
            f"{name} {medians['F.linear'] / m:.2f}x" for name, m in medians.items() if name != "F.linear"
        )
        print(f"rows {rows:4d}: {cells}  (over F.linear: {ratios})")


def bfloat16(all_linears: list[Linear], rows_list: list[int]) -> None:
    """oneDNN's packed bfloat16 kernel, the pair-layout kernel and the block kernel's bfloat16
    entry, each on its own copy of the weights (the blocks: the file's own)."""
    if not cpu_multiplies_bfloat16():
        sys.exit("this CPU does not multiply bfloat16: oneDNN's bfloat16 and the pair kernel do not run here")
    pair, kernel = pair_kernel(), block_kernel(torch.bfloat16)
    dense = {id(lin): lin.weight.bfloat16() for lin in all_linears}
    onednn = {key: torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT) for key, w in dense.items()}
    runs: dict[str, Callable[[Linear, torch.Tensor], object]] = {
        "oneDNN packed": lambda lin, x: torch.ops.mkldnn._linear_pointwise(
            x, onednn[id(lin)], None, "none", [], ""
        )
    }
    if pair is not None and all(pair.supports(w) for w in dense.values()):
        pairs = {key: cpu_pair_linear.pack(w) for key, w in dense.items()}
        runs[f"pair ({pair.engine})"] = lambda lin, x: pair(x, pairs[id(lin)])
    if kernel is not None and all(lin.blocks is not None for lin in all_linears):
        runs["blocks"] = lambda lin, x: kernel(x, lin.blocks)
    for rows in rows_list:
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(5):
            for name, run in runs.items():
                if name.startswith("pair") and rows > cpu_pair_linear.MAX_ROWS:
                    continue
                times[name].append(one_pass(all_linears, rows, run, torch.bfloat16))
        medians = {name: statistics.median(t) for name, t in times.items() if t}
        cells = ", ".join(f"{name} {m * 1e3:7.1f} ms" for name, m in medians.items())
        print(f"rows {rows:4d}: {cells}")


if __name__ == "__main__":
    main()

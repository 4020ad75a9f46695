"""The block kernel of another revision against this tree's, in one process, on SmolLM2's linears.

    .venv/bin/python bench/block_linear_ab.py --rev HEAD~1 [--rows 1 2 4 6] [--dtype float32]

Both libraries are built (or found in the kernel cache) from their own kernels/cpu sources
(`git archive` of --rev for the other) and multiply the GGUF file's own blocks: the 30 layers'
four linears and the LM head, every weight streamed once a pass, as a decode step does. The two
take turns, the order swapped each repeat, so a slow stretch of the machine falls on both; it
prints each one's median and interquartile range and the ratio of the medians, and says whether
their outputs are the same bits. The other revision's library is opened as this tree's would be,
so its C entries must take the same arguments as this tree's, its codebook tables included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode_attention_ab import sources_at  # bench/, beside this script

from gpu_worker.linear import Linear
from gpu_worker.loader import load_block_weights, load_model
from gpu_worker.model import LlamaModel
from kernels.cpu_block_linear import BlockLinear, open_library
from scheduler.model_files import find_default_model


def one_pass(
    kernel: BlockLinear, linears: list[Linear], inputs: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    out = []
    for lin in linears:
        assert lin.blocks is not None
        out.append(kernel(inputs[lin.blocks.k], lin.blocks))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rev", required=True, help="the other revision (git rev) whose kernels/cpu to build"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=40, help="at least 2 (the IQR needs two)")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats: at least 2, for the interquartile range")
    torch.set_num_threads(2)
    dtype = getattr(torch, args.dtype)
    path = find_default_model()
    config, weights = load_model(path)
    model = LlamaModel(config, torch.float32, "cpu")
    model.load_weights(weights, load_block_weights(path, config))
    linears = [lin for lin in model.linears() if lin.blocks is not None]
    with tempfile.TemporaryDirectory() as scratch:
        kernels = {
            args.rev: BlockLinear(open_library(dtype, sources_at(args.rev, Path(scratch)))),
            "this tree": BlockLinear(open_library(dtype)),
        }
    print(
        f"# {path.name}: {len(linears)} linears on their GGUF blocks, x in {args.dtype}, medians of {args.repeats}"
    )
    same = True
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(dtype) for k in {lin.weight.shape[1] for lin in linears}}
        outputs = {name: one_pass(kernel, linears, inputs) for name, kernel in kernels.items()}
        theirs, ours = outputs.values()
        same = same and all(torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for repeat in range(args.repeats):
            order = list(kernels.items())
            for name, kernel in order if repeat % 2 == 0 else reversed(order):
                started = time.perf_counter()
                one_pass(kernel, linears, inputs)
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        cells = []
        for name, t in times.items():
            low, _, high = statistics.quantiles([s * 1e3 for s in t], n=4)
            cells.append(f"{name} {medians[name]:.2f} ms (IQR {low:.2f}-{high:.2f})")
        print(
            f"rows {rows:3d}: {', '.join(cells)}; {args.rev} / this tree {medians[args.rev] / medians['this tree']:.3f}x"
        )
    print("outputs: the same bits" if same else "outputs: they differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

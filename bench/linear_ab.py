"""A/B of SmolLM2's float32 linears (30 layers and the LM head): `F.linear` against oneDNN's packed
kernel, which the worker takes in float32 where it runs (gpu_worker/linear.py).

    .venv/bin/python bench/linear_ab.py

Each pass streams every weight once, as a decode step does; the two take turns, medians of 5.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_worker.linear import Linear
from gpu_worker.loader import load_model
from gpu_worker.model import DecoderLayer, LlamaModel
from scheduler.model_files import find_default_model


def linears(model: LlamaModel) -> list[Linear]:
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    found: list[Linear] = [model.lm_head_linear]
    for layer in layers:
        found += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
    return found


def one_pass(all_linears: list[Linear], rows: int, packed: bool) -> float:
    inputs = {size: torch.randn(rows, size) for size in {lin.weight.shape[1] for lin in all_linears}}
    started = time.perf_counter()
    for lin in all_linears:
        x = inputs[lin.weight.shape[1]]
        if packed:
            lin(x)
        else:
            F.linear(x, lin.weight, lin.bias)
    return time.perf_counter() - started


def main() -> None:
    torch.set_num_threads(2)
    config, weights = load_model(find_default_model())
    model = LlamaModel(config, torch.float32, "cpu")
    model.load_weights(weights)
    all_linears = linears(model)
    if not all(lin.packed for lin in all_linears):
        sys.exit("oneDNN's packed float32 linear does not run here: nothing to compare")
    for rows in (1, 8, 64, 256):
        plain, packed = [], []
        for _ in range(5):
            plain.append(one_pass(all_linears, rows, packed=False))
            packed.append(one_pass(all_linears, rows, packed=True))
        a, b = statistics.median(plain), statistics.median(packed)
        print(f"rows {rows:4d}: F.linear {a * 1e3:7.1f} ms, oneDNN packed {b * 1e3:7.1f} ms, {a / b:.2f}x")


if __name__ == "__main__":
    main()

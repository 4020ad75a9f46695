"""Decode-attention microbenchmark: the paged kernel against gather + scaled_dot_product_attention.

    python bench/decode_attention.py                 # CUDA: the Triton kernel; CPU: the C kernel
    python bench/decode_attention.py --json out.json
    python bench/decode_attention.py --int8          # also the int8 KV cache against the dense one

For each (sequences, context) case it times, on the same cache and block tables:
- the kernel reading the paged cache in place (Triton on CUDA, kernels/cpu on the CPU);
- the baseline: gather every sequence's blocks into a padded buffer, then SDPA (GQA);
and prints milliseconds, the speedup, and the kernel's achieved bandwidth (bytes of K and V it
must read / time) as a fraction of the device's memory bandwidth. On CUDA both are also timed as
replays of a captured CUDA graph (device time without Python's launch cost, as the worker runs
decode steps), and the bandwidth comes from that time. The peak is `--peak-gbs`, else the
nominal figure for known GPUs, else a large device-to-device copy measured here.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

NOMINAL_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}
CASES = [(1, 8192), (8, 2048), (64, 512), (256, 1024), (128, 4096)]
CPU_CASES = [(1, 4096), (16, 1024), (64, 320)]


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats * 1e3


def graph_ms(fn: Callable[[], torch.Tensor], repeats: int = 50) -> tuple[float, torch.Tensor]:
    """Device time of `fn` captured once as a CUDA graph and replayed (no Python launch cost), and
    the graph's output after the replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats, output


def measured_copy_gbs(device: torch.device) -> float:
    """Read + write bandwidth of a 1 GiB (CUDA) / 256 MiB (CPU) tensor copy."""
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, repeats=5)
    return 2 * size / (ms / 1e3) / 1e9


def peak_gbs(device: torch.device, given: float | None) -> tuple[float, str]:
    if given:
        return given, "given"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in NOMINAL_GBS.items():
            if key in name:
                return value, f"nominal {name}"
    return measured_copy_gbs(device), "measured copy"


def make_case(
    num_seqs: int, context: int, dtype: torch.dtype, device: torch.device, heads: int = 9, kv_heads: int = 3
) -> dict[str, torch.Tensor]:
    block, dim = 16, 64
    per_seq = -(-context // block)
    num_blocks = num_seqs * per_seq + 1
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: num_seqs * per_seq].view(num_seqs, per_seq)
    return {
        "q": torch.randn(num_seqs, heads, dim, dtype=dtype, device=device),
        "k_cache": torch.randn(num_blocks, block, kv_heads, dim, dtype=dtype, device=device),
        "v_cache": torch.randn(num_blocks, block, kv_heads, dim, dtype=dtype, device=device),
        "tables": tables.to(torch.int32).to(device),
        "lens": torch.full((num_seqs,), context, dtype=torch.int32, device=device),
    }


def baseline(case: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    q, k_cache, v_cache, tables = case["q"], case["k_cache"], case["v_cache"], case["tables"]
    num_seqs, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    flat = tables.long().view(-1)
    length = tables.shape[1] * k_cache.shape[1]

    def run() -> torch.Tensor:
        keys = k_cache.index_select(0, flat).view(num_seqs, length, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(num_seqs, length, kv_heads, dim).transpose(1, 2)
        queries = q.view(num_seqs, kv_heads, heads // kv_heads, dim)
        return F.scaled_dot_product_attention(queries, keys, values)

    return run


def kernel(case: dict[str, torch.Tensor], device: torch.device, context: int) -> Callable[[], torch.Tensor]:
    q, k_cache, v_cache, tables, lens = (case[k] for k in ("q", "k_cache", "v_cache", "tables", "lens"))
    if device.type == "cuda":
        from kernels.paged_attention import paged_decode_attention

        return lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, context)
    from kernels.cpu_decode import load_cpu_decode_attention

    cpu_kernel = load_cpu_decode_attention(
        q.shape[2], q.shape[1] // k_cache.shape[2], k_cache.shape[1], q.dtype
    )
    return lambda: cpu_kernel(q, k_cache, v_cache, tables, lens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--peak-gbs", type=float, help="the device's memory bandwidth, GB/s")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--layers", type=int, default=30, help="CPU: layers' caches per step in the paths table"
    )
    parser.add_argument("--rounds", type=int, default=3, help="CPU: interleaved rounds in the paths table")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also the kernel on an int8 cache (--kv-cache-dtype int8) against the dense one",
    )
    parser.add_argument(
        "--model-steps",
        action="store_true",
        help="CPU: also SmolLM2's whole float32 decode step on each path",
    )
    args = parser.parse_args(argv)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    dtype = getattr(torch, args.dtype)
    peak, source = peak_gbs(device, args.peak_gbs)
    print(
        f"# decode attention on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
        f"{args.dtype}, 9 query / 3 KV heads of 64, blocks of 16; peak {peak:.0f} GB/s ({source})"
    )
    graphed = f" {'graph ms':>9} {'base ms':>9} {'speedup':>8}" if device.type == "cuda" else ""
    print(
        f"  {'seqs':>5} {'context':>8} {'kernel ms':>10} {'gather+SDPA ms':>15} {'speedup':>8}{graphed}"
        f" {'GB/s':>8} {'of peak':>8}"
    )
    rows = []
    for num_seqs, context in CASES if device.type == "cuda" else CPU_CASES:
        case = make_case(num_seqs, context, dtype, device)
        ours = kernel(case, device, context)
        reference = baseline(case)
        torch.testing.assert_close(
            ours().float().view(num_seqs, -1), reference().float().reshape(num_seqs, -1), atol=3e-2, rtol=3e-2
        )
        kernel_ms = time_ms(ours, device)
        baseline_ms = time_ms(reference, device)
        row = {
            "seqs": num_seqs,
            "context": context,
            "kernel_ms": kernel_ms,
            "baseline_ms": baseline_ms,
            "speedup": baseline_ms / kernel_ms,
        }
        # On a GPU the launched times are mostly Python launch cost; the replayed graph is the
        # device's time, and the bandwidth is computed from it.
        device_ms = kernel_ms
        if device.type == "cuda":
            row["kernel_graph_ms"] = device_ms = graph_ms(ours)[0]
            row["baseline_graph_ms"] = graph_ms(reference)[0]
            row["graph_speedup"] = row["baseline_graph_ms"] / device_ms
        kv_bytes = (
            2 * num_seqs * context * case["k_cache"].shape[2] * case["k_cache"].shape[3] * dtype.itemsize
        )
        row["gbs"] = gbs = kv_bytes / (device_ms / 1e3) / 1e9
        row["fraction_of_peak"] = gbs / peak
        rows.append(row)
        graphed = (
            f" {row['kernel_graph_ms']:>9.3f} {row['baseline_graph_ms']:>9.3f} {row['graph_speedup']:>7.2f}x"
            if device.type == "cuda"
            else ""
        )
        print(
            f"  {num_seqs:>5} {context:>8} {kernel_ms:>10.3f} {baseline_ms:>15.3f} {baseline_ms / kernel_ms:>7.2f}x"
            f"{graphed} {gbs:>8.0f} {gbs / peak:>7.1%}",
            flush=True,
        )
    result: dict[str, object] = {"device": str(device), "dtype": args.dtype, "peak_gbs": peak, "rows": rows}
    if device.type == "cuda" and args.int8:
        result["int8_cache"] = cuda_int8_cache(dtype, device, rows, peak)
    if device.type == "cpu":
        result["vector_paths"] = cpu_vector_paths(dtype, args.layers, args.rounds)
        if args.int8:
            result["int8_cache"] = cpu_int8_cache(dtype, args.layers, args.rounds)
        if args.model_steps:
            result["model_steps"] = cpu_model_steps(args.rounds)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def layers_step(
    kernel: Callable[..., torch.Tensor], cases: list[dict[str, torch.Tensor]]
) -> Callable[[], None]:
    """One decode step's attention: the kernel on each layer's case in turn."""

    def step() -> None:
        for c in cases:
            kernel(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["lens"])

    return step


def read_step(cases: list[dict[str, torch.Tensor]]) -> Callable[[], None]:
    """Every layer's K and V cache read once, front to back, with next to no arithmetic: a floor
    for a kernel that must read them (each case's cache holds its sequences' blocks and one more)."""

    def step() -> None:
        for c in cases:
            c["k_cache"].view(torch.int64).sum()
            c["v_cache"].view(torch.int64).sum()

    return step


def cpu_vector_paths(dtype: torch.dtype, layers: int, rounds: int) -> list[dict[str, object]]:
    """Each intrinsics path of the CPU kernel this CPU can run (kernels/cpu_decode.py's vector_bits),
    side by side, over `layers` layers' caches in turn as a decode step reads them: the KV cache
    streams from memory rather than sitting in the last-level cache. Best of `rounds` interleaved
    rounds of 10 steps."""
    from kernels.cpu_decode import VECTOR_BITS, VECTOR_PATHS, load_cpu_decode_attention

    kernels = {}
    for bits in VECTOR_BITS:
        loaded = load_cpu_decode_attention(64, 3, 16, dtype, bits)
        if loaded.vector_path == bits:  # what this CPU and shape can take
            kernels[bits] = loaded
    print(f"\n# the CPU kernel's paths, {layers} layers' caches, ms per step (all layers), best of {rounds}")
    print(
        "# read: the same caches summed front to back as int64, no attention: what reading the bytes"
        " alone takes (of read: that time over the fastest path's)"
    )
    print(
        f"  {'seqs':>5} {'context':>8} "
        + " ".join(f"{VECTOR_PATHS[b]:>9}" for b in kernels)
        + f" {'GB/s':>8} {'read':>8} {'of read':>8}"
    )
    rows = []
    for num_seqs, context in [(1, 320), (1, 4096), (16, 1024), (64, 320)]:
        cases = [make_case(num_seqs, context, dtype, torch.device("cpu")) for _ in range(layers)]
        best = {bits: float("inf") for bits in kernels}
        read = float("inf")
        for _ in range(rounds):
            for bits, loaded in kernels.items():
                best[bits] = min(
                    best[bits], time_ms(layers_step(loaded, cases), torch.device("cpu"), repeats=10)
                )
            read = min(read, time_ms(read_step(cases), torch.device("cpu"), repeats=10))
        kv_bytes = 2 * num_seqs * context * 3 * 64 * dtype.itemsize * layers
        fastest = min(best.values())
        rows.append(
            {
                "seqs": num_seqs,
                "context": context,
                "ms": {VECTOR_PATHS[b]: ms for b, ms in best.items()},
                "read_ms": read,
            }
        )
        print(
            f"  {num_seqs:>5} {context:>8} "
            + " ".join(f"{ms:>9.2f}" for ms in best.values())
            + f" {kv_bytes / fastest / 1e6:>8.1f} {read:>8.2f} {read / fastest:>7.0%}",
            flush=True,
        )
    return rows


def cuda_int8_cache(
    dtype: torch.dtype, device: torch.device, dense_rows: list[dict[str, float]], peak: float
) -> list[dict[str, object]]:
    """The Triton kernel on each case's cache quantized to int8, as replays of a captured graph,
    beside the dense cache's graph time from the table above."""
    from kernels.kv_int8 import quantize_cache
    from kernels.paged_attention import paged_decode_attention

    print("\n# the Triton kernel on an int8 cache (--kv-cache-dtype int8), graph replays")
    print(
        f"  {'seqs':>5} {'context':>8} {'dense ms':>9} {'int8 ms':>9} {'speedup':>8} {'GB/s':>8} {'of peak':>8}"
    )
    rows: list[dict[str, object]] = []
    for (num_seqs, context), dense in zip(CASES, dense_rows, strict=True):
        case = make_case(num_seqs, context, dtype, device)
        k_cache, v_cache = quantize_cache(case["k_cache"]), quantize_cache(case["v_cache"])

        def run(
            case: dict[str, torch.Tensor] = case,
            k: object = k_cache,
            v: object = v_cache,
            context: int = context,
        ) -> torch.Tensor:
            return paged_decode_attention(case["q"], k, v, case["tables"], case["lens"], context)  # type: ignore[arg-type]

        int8_ms = graph_ms(run)[0]
        gbs = 2 * num_seqs * context * 3 * (64 + 4) / (int8_ms / 1e3) / 1e9
        row: dict[str, object] = {
            "seqs": num_seqs,
            "context": context,
            "dense_ms": dense["kernel_graph_ms"],
            "int8_ms": int8_ms,
        }
        rows.append(row)
        print(
            f"  {num_seqs:>5} {context:>8} {dense['kernel_graph_ms']:>9.3f} {int8_ms:>9.3f} "
            f"{dense['kernel_graph_ms'] / int8_ms:>7.2f}x {gbs:>8.0f} {gbs / peak:>7.1%}",
            flush=True,
        )
    return rows


def cpu_int8_cache(dtype: torch.dtype, layers: int, rounds: int) -> list[dict[str, object]]:
    """The CPU kernel's widest path on the dense cache and on the same cache quantized to int8
    (kernels/kv_int8.py), `layers` layers' caches a step as in the paths table; best of `rounds`
    interleaved rounds of 10 steps. Bytes: what each must read (an int8 row and its scale)."""
    from kernels.cpu_decode import load_cpu_decode_attention
    from kernels.kv_int8 import quantize_cache

    kernels = {
        "dense": load_cpu_decode_attention(64, 3, 16, dtype),
        "int8": load_cpu_decode_attention(64, 3, 16, dtype, kv_int8=True),
    }
    print(
        f"\n# the CPU kernel on a {str(dtype).removeprefix('torch.')} cache and on int8, {layers} layers' caches, ms per step, best of {rounds}"
    )
    print(
        f"  {'seqs':>5} {'context':>8} {'dense ms':>9} {'int8 ms':>9} {'speedup':>8} {'dense GB/s':>11} {'int8 GB/s':>10}"
    )
    rows = []
    for num_seqs, context in [(1, 320), (1, 4096), (16, 1024), (64, 320)]:
        dense = [make_case(num_seqs, context, dtype, torch.device("cpu")) for _ in range(layers)]
        cases = {
            "dense": dense,
            "int8": [
                dict(c, k_cache=quantize_cache(c["k_cache"]), v_cache=quantize_cache(c["v_cache"]))
                for c in dense
            ],  # type: ignore[dict-item]
        }
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(rounds):
            for name, kernel in kernels.items():
                best[name] = min(
                    best[name], time_ms(layers_step(kernel, cases[name]), torch.device("cpu"), repeats=10)
                )
        elements = 2 * num_seqs * context * 3 * layers  # rows of K and V read
        dense_gbs = elements * 64 * dtype.itemsize / best["dense"] / 1e6
        int8_gbs = elements * (64 + 4) / best["int8"] / 1e6
        rows.append({"seqs": num_seqs, "context": context, "ms": best})
        print(
            f"  {num_seqs:>5} {context:>8} {best['dense']:>9.2f} {best['int8']:>9.2f} "
            f"{best['dense'] / best['int8']:>7.2f}x {dense_gbs:>11.1f} {int8_gbs:>10.1f}",
            flush=True,
        )
    return rows


def cpu_model_steps(rounds: int) -> list[dict[str, object]]:
    """SmolLM2's whole float32 decode step in process, as the worker builds it (GGUF-block linears,
    the one-call decode stack), its decode attention on each intrinsics path this CPU can take:
    1 and 64 sequences at 320 tokens of context, best of `rounds` interleaved rounds of 7 steps."""
    from gpu_worker.attention import CpuPagedAttention
    from gpu_worker.batch import ScheduledChunk, build_forward_batch
    from gpu_worker.kv_cache import allocate_kv_cache
    from gpu_worker.loader import load_block_weights, load_model
    from gpu_worker.model import LlamaModel
    from gpu_worker.startup import make_attention
    from kernels.cpu_decode import VECTOR_BITS, VECTOR_PATHS, load_cpu_decode_attention
    from kernels.cpu_stack import load_cpu_decode_stack
    from scheduler.model_files import find_default_model

    block, context, cpu = 16, 320, torch.device("cpu")
    path = find_default_model()
    config, weights = load_model(path)
    model = LlamaModel(config, torch.float32, cpu)
    model.load_weights(weights, load_block_weights(path, config))
    attention = make_attention("cpu", config, torch.float32, cpu, block)
    assert isinstance(attention, CpuPagedAttention)
    model.use_attention(attention)
    group = config.num_heads // config.num_kv_heads
    paths = {}
    for bits in VECTOR_BITS:
        kernel = load_cpu_decode_attention(config.head_dim, group, block, torch.float32, bits)
        if kernel.vector_path == bits:
            paths[bits] = (
                kernel,
                load_cpu_decode_stack(config.head_dim, group, block, blocks=True, vector_bits=bits),
            )
    print(f"\n# {path.name}, float32, one decode step at {context} tokens of context, ms, best of {rounds}")
    print(f"  {'seqs':>5} " + " ".join(f"{VECTOR_PATHS[b]:>9}" for b in paths))
    rows: list[dict[str, object]] = []
    for num_seqs in (1, 64):
        per = context // block
        kv = allocate_kv_cache(config, num_seqs * per, block, torch.float32, cpu)
        for k, v in kv:
            k.normal_()
            v.normal_()
        chunks = [
            ScheduledChunk([7], context - 1, list(range(i * per, (i + 1) * per)), False)
            for i in range(num_seqs)
        ]
        batch = build_forward_batch(chunks, block, "cpu")
        step = functools.partial(model, batch, kv)
        best = {bits: float("inf") for bits in paths}
        for _ in range(rounds):
            for bits, (kernel, stack) in paths.items():
                attention.kernel, attention.decode_stack = kernel, stack
                best[bits] = min(best[bits], time_ms(step, cpu, repeats=7))
        rows.append(
            {"seqs": num_seqs, "context": context, "ms": {VECTOR_PATHS[b]: ms for b, ms in best.items()}}
        )
        print(f"  {num_seqs:>5} " + " ".join(f"{ms:>9.2f}" for ms in best.values()), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

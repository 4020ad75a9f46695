"""Would int8 dot products multiply a Q4_1 model faster than the pair-layout kernel's bfloat16 ones?

    python bench/int8_probe.py                  # SmolLM2-135M's four linears at 128 and 2048 rows
    python bench/int8_probe.py --rows 64 512 --json out.json

On a CPU with AVX-512 VNNI and BF16, this prints:
- the throughput of vpdpbusd (int8, 64 multiply-adds an instruction) and vdpbf16ps (bfloat16, 32)
  alone in registers, both threads: the most either could give;
- SmolLM2-135M's four linears (qkv, o, gate_up, down) at each `--rows`, one layer's shapes with
  random weights, through duoserve's pair-layout kernel in bfloat16 and through
  bench/int8_probe.c's Q4_1 x int8 tile kernel (Q4_1's 4-bit weights with a scale and a minimum
  per 32, the activations quantized to int8 per 32 as llama.cpp does): milliseconds, the best of
  `--repeats`, the two alternating, and their ratio.

The int8 kernel's result is checked first against the same integer arithmetic in float64. Its
time leaves out quantizing the activations, which a real path would pay each step, so the ratio
flatters it. Nothing here is served: the probe tells whether an int8 path is worth building.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from decode_attention_ab import best_ms  # bench/, beside this script

from gpu_worker.linear import pair_kernel
from kernels import cpu_pair_linear
from kernels.cpu_build import KernelBuildError, build, cpu_has, load

HERE = Path(__file__).resolve().parent
# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536; (n, k) of each linear.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
TILE_ROWS, TILE_COLUMNS = 8, 32  # bench/int8_probe.c's register tile


def peaks(lib: ctypes.CDLL, threads: int, iters: int = 50_000_000) -> dict[str, float]:
    """Giga-operations a second (a multiply-add counts two) of each instruction alone, best of 3."""
    lib.probe_bf16_peak.restype = lib.probe_int8_peak.restype = ctypes.c_double
    found = {}
    for name, function, per_call in (
        ("vdpbf16ps", lib.probe_bf16_peak, 12 * 32 * 2),
        ("vpdpbusd", lib.probe_int8_peak, 12 * 64 * 2),
    ):
        seconds = min(function(ctypes.c_int64(iters), threads) for _ in range(3))
        found[name] = iters * threads * per_call / seconds / 1e9
    return found


class Q4Linear:
    """One linear in Q4_1's form, packed for probe_q4_gemm, with its float64 reference."""

    def __init__(self, n: int, k: int, generator: torch.Generator) -> None:
        self.n, self.k = n, k
        blocks = k // 32
        self.q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
        self.d = torch.rand(n, blocks, generator=generator) * 0.02 + 0.001
        self.m = -8 * self.d * (1 + 0.1 * torch.randn(n, blocks, generator=generator))
        self.w = self.q.view(n // 16, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
        self.wd = self.d.view(n // 16, 16, blocks).permute(0, 2, 1).contiguous()
        self.wm = self.m.view(n // 16, 16, blocks).permute(0, 2, 1).contiguous()

    def dense_bfloat16(self) -> torch.Tensor:  # [n, k]
        per_weight = torch.repeat_interleave
        return (self.q.float() * per_weight(self.d, 32, dim=1) + per_weight(self.m, 32, dim=1)).bfloat16()

    def reference(self, xq: torch.Tensor, xd: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:  # [rows, n]
        rows, blocks = xq.shape[0], self.k // 32
        sums = torch.einsum(
            "rbk,nbk->rnb", xq.double().view(rows, blocks, 32), self.q.double().view(self.n, blocks, 32)
        )
        return (
            sums * self.d.double() * xd.double()[:, None, :] + self.m.double() * xs.double()[:, None, :]
        ).sum(-1)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, k] → int8 values, a scale per 32 (dx) and dx * their sum per 32 (sx)."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    scale = blocks.abs().amax(-1).clamp_min(1e-12) / 127
    q = torch.round(blocks / scale[..., None]).to(torch.int8)
    return q.view(rows, k).contiguous(), scale.contiguous(), (scale * q.float().sum(-1)).contiguous()


def run_all(calls: list[Callable[[], object]]) -> None:
    for call in calls:
        call()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 2048], help=f"multiples of {TILE_ROWS}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--peak-iters", type=int, default=50_000_000, help="loop trips of each instruction-alone timing"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if bad := [rows for rows in args.rows if rows <= 0 or rows % TILE_ROWS]:
        parser.error(f"--rows: {bad} are not positive multiples of {TILE_ROWS}")
    missing = [flag for flag in ("avx512_vnni", "avx512_bf16") if not cpu_has(flag)]
    if missing:
        print(f"# this CPU lacks {', '.join(missing)}: nothing to probe")
        return 1
    pair = pair_kernel()
    try:
        lib = load(build("int8_probe.c", {}, sources=HERE))
    except KernelBuildError as exc:
        print(f"# cannot build bench/int8_probe.c: {exc}")
        return 1
    if pair is None:
        print("# the pair-layout kernel does not load here: nothing to compare with")
        return 1
    threads = torch.get_num_threads()
    found = peaks(lib, threads, args.peak_iters)
    print(
        f"# {threads} threads; instructions alone: "
        + ", ".join(f"{k} {v:.0f} G ops/s" for k, v in found.items())
    )
    generator = torch.Generator().manual_seed(0)
    linears = {name: Q4Linear(n, k, generator) for name, (n, k) in SHAPES.items()}
    packed = {name: cpu_pair_linear.pack(linear.dense_bfloat16()) for name, linear in linears.items()}
    results: dict[str, dict[str, float]] = {}
    print("| rows | pair layout, bfloat16, ms | Q4_1 x int8, ms | int8 / pair speed |")
    print("|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, 1536, generator=generator)
        int8_calls: list[Callable[[], object]] = []
        pair_calls: list[Callable[[], object]] = []
        keep_alive = []  # the C calls hold only these tensors' addresses
        for name, linear in linears.items():
            inputs = x[:, : linear.k].contiguous()
            xq, xd, xs = quantize(inputs)
            y = torch.empty(rows, linear.n)
            tensors = (linear.w, linear.wd, linear.wm, xq, xd, xs, y)
            keep_alive.append(tensors)
            call = partial(
                lib.probe_q4_gemm,
                *(ctypes.c_void_p(t.data_ptr()) for t in tensors),
                ctypes.c_int64(rows),
                ctypes.c_int64(linear.n),
                ctypes.c_int64(linear.k),
                threads,
            )
            call()
            expected = linear.reference(xq, xd, xs)
            error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
            if error > 1e-5:
                raise SystemExit(
                    f"{name} at {rows} rows: the int8 kernel is off by {error:.2e} of the largest value"
                )
            int8_calls.append(call)
            pair_calls.append(partial(pair, inputs.bfloat16(), packed[name]))
        int8_ms, pair_ms = float("inf"), float("inf")
        for _ in range(3):  # alternating, so drift in the machine's speed falls on both
            pair_ms = min(pair_ms, best_ms(partial(run_all, pair_calls), args.repeats))
            int8_ms = min(int8_ms, best_ms(partial(run_all, int8_calls), args.repeats))
        results[str(rows)] = {"pair_ms": pair_ms, "int8_ms": int8_ms}
        print(f"| {rows} | {pair_ms:.3f} | {int8_ms:.3f} | {pair_ms / int8_ms:.2f}x |")
    if args.json:
        args.json.write_text(
            json.dumps({"peaks_gops": found, "threads": threads, "linears": results}, indent=1)
        )
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU decode attention kernel of this checkout against another revision's, side by side.

    python bench/decode_attention_ab.py --rev 0606b09
    python bench/decode_attention_ab.py --rev 0606b09 --dtype bfloat16 --json out.json
    python bench/decode_attention_ab.py --rev 0606b09 --vector-bits 256   # the AVX2 path

Builds kernels/cpu/paged_decode_attention.c as it is here and as it was at `--rev` (its
kernels/cpu folder, from git), both for SmolLM2's shape (9 query / 3 KV heads of 64, blocks of
16), and times one decode step's attention over 30 layers' caches (the KV cache streams from
memory, as when serving) for a few (sequences, context) cases. Both are called straight through
ctypes with preallocated outputs, so the launcher's checks in Python are not timed. Rounds take
turns; each figure is the best of `--rounds` rounds of 10 steps. Outputs are compared first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from io import BytesIO
from pathlib import Path

import torch
from decode_attention import make_case  # bench/, beside this script

from kernels.cpu_build import SOURCES, build, load

ROOT = Path(__file__).resolve().parent.parent

CASES = [(1, 320), (1, 4096), (2, 2048), (4, 1024), (16, 1024), (64, 320)]
LAYERS = 30


def sources_at(rev: str, into: Path) -> Path:
    """kernels/cpu as it was at `rev`, written under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "kernels/cpu"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "kernels" / "cpu"


def bind(path: Path, sources: Path) -> Callable[..., None]:
    """The kernel's entry point as (q, k_cache, v_cache, tables, lens, out, num_seqs, kv_heads,
    max_blocks, scale, threads). From 4dcfc9c on it also takes the int8 cache's two scale
    pointers after v_cache: they are passed as NULL."""
    function = load(path).duoserve_paged_decode_attention
    function.restype = None
    with_scales = "const float *k_scale" in (sources / "paged_decode_attention.c").read_text()
    pointers = 8 if with_scales else 6
    function.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int]
    if not with_scales:
        return function

    def with_null_scales(q: int, k: int, v: int, *rest: object) -> None:
        function(q, k, v, None, None, *rest)

    return with_null_scales


def smollm2_defines(dtype: torch.dtype, vector_bits: int = 512) -> dict[str, int]:
    """The kernel's build for SmolLM2's attention (9 query / 3 KV heads of 64, blocks of 16) on a
    `dtype` cache, taking vectors of at most `vector_bits` (512, 256 or 0, as the worker's
    --cpu-vector-bits)."""
    return {
        "HEAD_DIM": 64,
        "GROUP": 3,
        "BLOCK": 16,
        "ELEM_BF16": int(dtype == torch.bfloat16),
        "VECTOR_BITS": vector_bits,
    }


def step(
    function: Callable[..., None], cases: list[dict[str, torch.Tensor]], outs: list[torch.Tensor]
) -> None:
    for case, out in zip(cases, outs, strict=True):
        num_seqs, max_blocks = case["tables"].shape
        function(
            case["q"].data_ptr(),
            case["k_cache"].data_ptr(),
            case["v_cache"].data_ptr(),
            case["tables"].data_ptr(),
            case["lens"].data_ptr(),
            out.data_ptr(),
            num_seqs,
            case["k_cache"].shape[2],
            max_blocks,
            case["q"].shape[2] ** -0.5,
            torch.get_num_threads(),
        )


def best_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", required=True, help="the git revision to compare against")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--vector-bits",
        type=int,
        default=512,
        choices=(512, 256, 0),
        help="the widest intrinsics path both builds may take, as the worker's --cpu-vector-bits",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    defines = smollm2_defines(dtype, args.vector_bits)
    ours = bind(build("paged_decode_attention.c", defines), SOURCES)
    with tempfile.TemporaryDirectory() as scratch:
        sources = sources_at(args.rev, Path(scratch))
        theirs = bind(build("paged_decode_attention.c", defines, sources=sources), sources)
    print(
        f"# CPU decode attention, {args.dtype}, at most {args.vector_bits}-bit vectors, {LAYERS} layers' caches: "
        f"{args.rev} against this checkout"
    )
    print(f"  {'seqs':>5} {'context':>8} {args.rev + ' ms':>14} {'here ms':>9} {'speed-up':>9}")
    rows = []
    for num_seqs, context in CASES:
        cases = [make_case(num_seqs, context, dtype, torch.device("cpu")) for _ in range(LAYERS)]
        outs = {name: [torch.empty_like(c["q"]) for c in cases] for name in ("theirs", "ours")}
        step(theirs, cases, outs["theirs"])
        step(ours, cases, outs["ours"])
        for a, b in zip(outs["theirs"], outs["ours"], strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        times: dict[str, list[float]] = {"theirs": [], "ours": []}
        for _ in range(args.rounds):
            for name, function in (("theirs", theirs), ("ours", ours)):
                times[name].append(best_ms(partial(step, function, cases, outs[name])))
        old, new = min(times["theirs"]), min(times["ours"])
        rows.append(
            {"seqs": num_seqs, "context": context, "rev_ms": old, "here_ms": new, "speedup": old / new}
        )
        print(f"  {num_seqs:>5} {context:>8} {old:>14.2f} {new:>9.2f} {old / new:>8.2f}x", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"rev": args.rev, "dtype": args.dtype, "vector_bits": args.vector_bits, "rows": rows},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

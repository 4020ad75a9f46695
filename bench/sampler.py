"""The worker's sampler on a step of 64 rows of real next-token logits, against another revision's.

    python bench/sampler.py --rev HEAD~1           # SmolLM2's logits, this checkout against HEAD~1
    python bench/sampler.py --rev HEAD --synthetic # random logits, no model (quick; a smoke run)

The logits are SmolLM2-135M-Instruct's (transformers, bfloat16, the default GGUF) for 64 chat
prompts at a few positions of a greedy continuation: what a decode step of 64 sequences hands the
sampler. For each sampling setting (logprobs asked for in two of them) the two revisions'
`Sampler.sample` are timed in turns (ms per step, best of --rounds rounds over every position), and
every row is drawn with a seed of its own by both, so the share of identical tokens says whether
the draws still invert the same distributions. A second table gives how many of the best tokens
hold each top-p nucleus, which is how gpu_worker/sampler.py's TOP_P_WIDTHS were chosen.

gpu_worker/sampler.py is taken from --rev, and so are the CPU kernels it calls (kernels/cpu_fused.py
and the kernels/cpu/fused_ops.c it builds); the rest of what they import comes from this checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from decode_attention_ab import sources_at
from transformers_baseline import load_transformers_model
from workloads import default_gguf, load_tokenizer

from gpu_worker.host_memory import keep_freed_memory
from kernels.cpu_build import build, load

ROOT = Path(__file__).resolve().parent.parent
ROWS = 64
SETTINGS = [
    {"temperature": 0.8},
    {"temperature": 0.8, "top_p": 0.95},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.8, "top_k": 50},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.95, "min_p": 0.02},
    {"temperature": 1.3, "top_p": 0.99},
    {"temperature": 0.8, "logprobs": 0},
    {"temperature": 0.8, "top_p": 0.95, "logprobs": 5},
]
NUCLEI = [(0.7, 0.9), (0.8, 0.95), (1.0, 0.9), (1.0, 0.95), (1.0, 0.99), (1.3, 0.99)]  # temperature, top_p
TOPICS = ["the moon", "a forest", "prime numbers", "rain", "cats", "the sea", "a city at night", "bread"]
KINDS = ["Write a short poem about", "Explain", "Tell me a story about", "List facts about"]
PROMPTS = [f"{kind} {topic}." for kind in KINDS for topic in TOPICS] * 2  # 64


def module_at(rev: str, path: str, into: Path) -> ModuleType:
    """The file `path` as it was at `rev`, imported as a module of its own; what it imports comes
    from this checkout."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    name = Path(path).stem + "_at_rev"
    (into / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, into / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def sampler_at(rev: str, into: Path, kernels: bool = True) -> ModuleType:
    """gpu_worker/sampler.py as it was at `rev`. With `kernels`, it calls `rev`'s bfloat16 fused
    ops (kernels/cpu_fused.py and the kernels/cpu/fused_ops.c it builds, as they were at `rev`);
    without, this checkout's."""
    module = module_at(rev, "gpu_worker/sampler.py", into)
    if kernels and hasattr(module, "_cpu_ops"):  # the list the sampler fills with its ops on first use
        fused = module_at(rev, "kernels/cpu_fused.py", into)
        library = load(build("fused_ops.c", {"ELEM_BF16": 1}, sources=sources_at(rev, into)))
        module._cpu_ops[:] = [fused.CpuFusedOps(library, torch.bfloat16)]
    return module


def model_logits(model_path: Path, positions: int) -> torch.Tensor:  # [positions, 64, V] bfloat16
    """SmolLM2's next-token logits for the 64 chat prompts, at every 4th of `positions` * 4 greedy
    tokens."""
    tokenizer = load_tokenizer(model_path)
    options = argparse.Namespace(model=model_path, hf_threads=0, hf_device="cpu")
    model, _ = load_transformers_model(options, "bfloat16")
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS
    ]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=4 * positions,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return torch.stack(list(out.logits[::4])).to(torch.bfloat16)


def synthetic_logits(positions: int, vocab: int = 49152) -> torch.Tensor:  # [positions, 64, V] bfloat16
    """Random logits shaped like a language model's: a few likely tokens over a long tail."""
    gen = torch.Generator().manual_seed(0)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = []
    for _ in range(positions * ROWS):
        slope = float(torch.empty(()).uniform_(1.0, 3.0, generator=gen))
        row = -slope * rank.log() + torch.randn(vocab, generator=gen) * 0.5
        rows.append(row[torch.randperm(vocab, generator=gen)])
    return torch.stack(rows).view(positions, ROWS, vocab).to(torch.bfloat16)


def time_sample(module: ModuleType, logits: torch.Tensor, setting: dict[str, Any]) -> float:
    """ms per step: `sample` (the tokens, and the logprobs asked for: what the CPU worker calls)
    over every position once, 256 prompt and 50 output tokens a row."""
    rows = [
        module.SamplingRow(module.SamplingParams(**setting), list(range(256)), list(range(50)))
        for _ in range(logits.shape[1])
    ]
    sampler = module.Sampler(0)
    started = time.perf_counter()
    for step in logits:
        sampler.sample(step, rows)
    return (time.perf_counter() - started) / logits.shape[0] * 1000


def seeded_tokens(module: ModuleType, logits: torch.Tensor, setting: dict[str, Any]) -> list[int]:
    """Every row's token with a seed of its own (its position in the run)."""
    tokens = []
    for index, step in enumerate(logits):
        rows = [
            module.SamplingRow(module.SamplingParams(**setting, seed=index * 1000 + row), [], [])
            for row in range(step.shape[0])
        ]
        tokens += module.Sampler(0).choose(step, rows).tolist()
    return tokens


def nucleus_sizes(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:  # [rows]
    """How many of each row's best tokens its top-p nucleus holds."""
    probs = torch.softmax(logits.flatten(0, 1).float() / temperature, dim=-1)
    ranked = probs.sort(dim=-1, descending=True).values
    return (ranked.cumsum(dim=-1) < top_p).sum(dim=-1) + 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", required=True, help="the git revision whose sampler to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--positions", type=int, default=6, help="decode positions of 64 rows each")
    parser.add_argument("--synthetic", action="store_true", help="random logits instead of the model's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.positions < 1:
        parser.error("--rounds and --positions must be at least 1")
    keep_freed_memory()  # as the worker: a step's buffers come back from malloc, not new pages
    from gpu_worker import sampler as here

    logits = (
        synthetic_logits(args.positions) if args.synthetic else model_logits(default_gguf(), args.positions)
    )
    source = "random" if args.synthetic else "SmolLM2's"
    print(f"# {source} logits, {logits.shape[0]} steps of {logits.shape[1]} rows of {logits.shape[2]}, "
          f"{torch.get_num_threads()} threads; ms per step, best of {args.rounds} rounds")  # fmt: skip
    print(f"  {'setting':<50} {args.rev + ' ms':>12} {'here ms':>9} {'speed-up':>9} {'same tokens':>12}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        theirs = sampler_at(args.rev, Path(scratch))
        for setting in SETTINGS:
            times: dict[str, list[float]] = {"theirs": [], "here": []}
            for module in (theirs, here):  # warm-up: first calls build kernels and generators
                time_sample(module, logits[:1], setting)
            for _ in range(args.rounds):
                times["theirs"].append(time_sample(theirs, logits, setting))
                times["here"].append(time_sample(here, logits, setting))
            old, new = min(times["theirs"]), min(times["here"])
            a, b = seeded_tokens(theirs, logits, setting), seeded_tokens(here, logits, setting)
            same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
            label = ", ".join(f"{k}={v}" for k, v in setting.items())
            print(f"  {label:<50} {old:>12.2f} {new:>9.2f} {old / new:>8.2f}x {same:>11.1%}", flush=True)
            rows.append(
                {"setting": setting, "rev_ms": old, "here_ms": new, "speedup": old / new, "same": same}
            )
    print("\n# tokens in each row's top-p nucleus (of the best ones, at that temperature)")
    print(
        f"  {'temperature':>11} {'top_p':>6} {'median':>7} {'p90':>6} {'max':>6}   rows within 64 / 512 / 4096"
    )
    nuclei = []
    for temperature, top_p in NUCLEI:
        sizes = nucleus_sizes(logits, temperature, top_p).float()
        within = [float((sizes <= w).float().mean()) for w in (64, 512, 4096)]
        median, p90 = float(sizes.median()), float(sizes.quantile(0.9))
        print(f"  {temperature:>11} {top_p:>6} {median:>7.0f} {p90:>6.0f} {float(sizes.max()):>6.0f}   "
              + " / ".join(f"{w:.0%}" for w in within))  # fmt: skip
        nuclei.append(
            {"temperature": temperature, "top_p": top_p, "median": median, "p90": p90, "within": within}
        )
    if args.json:
        args.json.write_text(
            json.dumps({"rev": args.rev, "source": source, "rows": rows, "nuclei": nuclei}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

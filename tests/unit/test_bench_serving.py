"""bench/serving.py's paired comparison of configs over rounds (--rounds)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import servers
import serving
import transformers_baseline


def _run(config: str, workload: str, round_index: int, tok_s: float) -> serving.RunSummary:
    return serving.RunSummary(
        engine="duoserve", config=config, dtype="bfloat16", workload=workload, mode="offline",
        num_requests=1, completed=1, errors=0, input_tokens=1, output_tokens=1, wall_s=1.0,
        output_tok_s=tok_s, total_tok_s=tok_s, extra={"round": round_index},
    )  # fmt: skip


def test_each_config_is_compared_with_the_baseline_of_the_same_round() -> None:
    runs = [
        _run("sbo", "random", 0, 100.0),
        _run("no-sbo", "random", 0, 110.0),
        _run("no-sbo", "random", 1, 90.0),
        _run("sbo", "random", 1, 100.0),
        _run("sbo", "single", 0, 20.0),
        _run("no-sbo", "single", 0, 20.0),
        _run("no-sbo", "single", 1, 30.0),  # its round's baseline is missing: not compared
    ]
    rows = {row["workload"]: row for row in serving.paired_ratios(runs, "sbo")}
    assert set(rows) == {"random", "single"}
    random_row = rows["random"]
    assert random_row["config"] == "no-sbo" and random_row["rounds"] == 2
    assert random_row["ratios"] == pytest.approx([1.1, 0.9])
    assert random_row["mean"] == pytest.approx(1.0)
    assert (random_row["min"], random_row["max"]) == pytest.approx((0.9, 1.1))
    assert random_row["sd"] == pytest.approx(0.1414, abs=1e-4)
    assert random_row["faster"] == 1
    assert rows["single"]["ratios"] == pytest.approx([1.0])
    assert rows["single"]["faster"] == 0 and rows["single"]["sd"] == 0.0


def test_runs_outside_rounds_and_transformers_runs_are_left_out() -> None:
    plain = _run("no-sbo", "random", 0, 50.0)
    plain.extra = {}
    theirs = _run("sbo", "random", 0, 10.0)
    theirs.engine = "transformers"
    assert serving.paired_ratios([plain, theirs, _run("sbo", "random", 0, 100.0)], "sbo") == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--rounds", "2", "--server", "localhost:1"], "does not take --server"),
    ],
)
def test_bad_rounds_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        serving.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_json_names_the_cpu_and_the_instruction_sets_the_kernels_choose_between() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this system")
    first = {}
    for line in cpuinfo.read_text().splitlines():  # the first processor's fields, read here apart
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set((first.get("flags") or first.get("Features", "")).split())
    described = serving.cpu_description()
    assert described["model_name"]
    assert (described["family"], described["model"]) == (first.get("cpu family"), first.get("model"))
    known = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    assert described["has"] == [flag for flag in known if flag in flags]


def test_triton_compiles_are_counted_from_the_cache_one_metadata_file_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Triton's cache as it lays a compiled kernel out: a folder per hash, holding the metadata
    # file and the binaries, and a group file (named __grp__) in a folder of its own.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert servers.triton_compiled_kernels() == 0  # no cache yet
    for n, name in enumerate(["_prefill_kernel", "_prefill_kernel", "_decode_reduce_kernel"]):
        folder = tmp_path / "cache" / f"hash{n}"
        folder.mkdir(parents=True)
        (folder / f"{name}.json").write_text("{}")
        (folder / f"{name}.cubin").write_bytes(b"")
        group = tmp_path / "cache" / f"group{n}"
        group.mkdir()
        (group / f"__grp__{name}.json").write_text("{}")
    assert servers.triton_compiled_kernels() == 3


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return serving.load_tokenizer(serving.default_gguf())


def test_each_run_and_the_warmup_draw_prompts_of_their_own(tokenizer: object) -> None:
    specs = serving.workload_specs(num_requests=4, input_len=24, output_len=2)
    first = serving.RoundPrompts(tokenizer, specs, ["random", "single"], seed=0)
    drawn = {
        "random": first.of("random"),
        "random at a rate": first.of("random", 1),
        "single": first.of("single"),
        "warm-up": [first.warmup()],
        "next round": serving.RoundPrompts(tokenizer, specs, ["random"], seed=1).of("random"),
    }
    assert [len(p) for p in drawn["random"]] == [24] * 4 and len(drawn["single"]) == 1
    prompts = [tuple(p) for batch in drawn.values() for p in batch]
    assert len(set(prompts)) == len(prompts) == 4 + 4 + 1 + 1 + 4
    # The same round asks again, or another process draws the same seed: the same prompts.
    assert first.of("random") is drawn["random"]
    assert serving.RoundPrompts(tokenizer, specs, ["single"], seed=0).of("single") == drawn["single"]


def test_a_run_counts_the_prompt_tokens_found_in_the_prefix_cache() -> None:
    spec = serving.WorkloadSpec("random", 2, 16, 2)
    results = [
        serving.RequestResult(
            0, 16, sent=0.0, first_token=0.1, last_token=0.2, token_ids=[5, 6], cached_prompt_tokens=16
        ),
        serving.RequestResult(1, 16, sent=0.0, first_token=0.1, last_token=0.3, token_ids=[7, 8]),
    ]
    summary = serving.summarize("duoserve", "dtype=float32", "float32", spec, "offline", results)
    assert summary.cached_prompt_tokens == 16 and summary.input_tokens == 32


def test_the_worker_split_reports_decode_steps_apart_from_steps_with_prompt_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = {
        "busy": 1.0,
        "sampling": 0.1,
        "wait": 0.0,
        "steps": 10.0,
        "decode_busy": 0.5,
        "decode_steps": 8.0,
    }
    after = {
        "busy": 4.0,
        "sampling": 0.25,
        "wait": 0.1,
        "steps": 40.0,
        "decode_busy": 2.5,
        "decode_steps": 36.0,
    }
    delta = servers.print_worker_split(before, after)
    assert delta["decode_steps"] == 28 and delta["decode_busy"] == pytest.approx(2.0)
    # 28 decode steps in 2.0 s; the other 2 steps took the remaining 1.0 s.
    assert servers.step_kinds(delta) == (
        "28 decode (2.00 s, 71.4 ms each), 2 with prompt tokens (1.00 s, 500.0 ms each)"
    )
    out = capsys.readouterr().out
    assert "#   worker: busy 3.00 s (sampling 0.15 s of it), waited 0.10 s" in out
    assert "#   worker steps: 28 decode" in out
    # A server that does not count decode steps: no line, no division by zero.
    assert servers.step_kinds({"busy": 1.0, "steps": 3.0}) == ""
    assert servers.step_kinds({**delta, "decode_steps": 30.0, "decode_busy": 3.0}).endswith(
        "0 with prompt tokens (0.00 s)"
    )


def _tiny_llama() -> Any:
    """A random two-layer Llama of 64 tokens, the same for every call."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _greedy_by_forward(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens after `prompt`, one full forward a token: no end-of-sequence rule."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_a_divergence_is_measured_by_the_reference_logits_between_the_two_tokens() -> None:
    import torch

    model = _tiny_llama()
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    theirs = [_greedy_by_forward(model, p, 3) for p in prompts]
    with torch.inference_mode():
        logits = model(torch.tensor([prompts[0] + theirs[0][:1]])).logits[0, -1]
    first, runner_up = torch.topk(logits, 2).indices.tolist()
    assert first == theirs[0][1]
    ours = [
        [theirs[0][0], runner_up, theirs[0][2]],
        list(theirs[1]),
    ]  # the first diverges at its second token

    gaps = transformers_baseline.divergence_gaps(model, "cpu", prompts, ours, theirs)

    assert len(gaps) == 1 and gaps[0]["index"] == 1
    assert gaps[0]["gap"] == pytest.approx(float(logits[first] - logits[runner_up]))
    assert gaps[0]["gap"] > 0
    top = float(logits[first])
    assert gaps[0]["top_logit"] == pytest.approx(top)
    eps = torch.finfo(torch.float32).eps
    assert abs(top) * eps / 2 < gaps[0]["rounding_step"] <= abs(top) * eps
    summary = transformers_baseline.summarize_gaps(gaps)
    assert summary["divergences"] == 1 and summary["gap_max"] == pytest.approx(gaps[0]["gap"])
    assert summary["gap_max_steps"] == pytest.approx(gaps[0]["gap"] / gaps[0]["rounding_step"])
    assert summary["reversed"] == 0
    swapped = transformers_baseline.summarize_gaps(
        transformers_baseline.divergence_gaps(model, "cpu", prompts, theirs, ours)
    )
    assert swapped["reversed"] == 1 and swapped["gap_max"] == pytest.approx(-gaps[0]["gap"])
    assert transformers_baseline.summarize_gaps([])["divergences"] == 0


def test_transformers_takes_an_end_of_sequence_token_like_any_other_as_ignore_eos_does() -> None:
    model = _tiny_llama()
    prompt = [1, 2, 3, 4]
    free = _greedy_by_forward(model, prompt, 6)
    model.generation_config.eos_token_id = free[2]  # greedy reaches "end of sequence" at its third token
    args = serving.build_parser().parse_args(["--no-warmup"])
    serving.resolve_sizes(args)
    spec = serving.WorkloadSpec("single", num_requests=1, input_len=len(prompt), output_len=6)

    _, outputs = serving.run_transformers(model, "cpu", args, "float32", spec, [prompt], pad_id=0)

    assert outputs == [free]


def test_greedy_agreement_counts_identical_outputs_and_the_common_prefix_of_the_others() -> None:
    ours = [[1, 2, 3, 4], [1, 2, 9, 9], [1, 2]]  # the same; differs at its third token; cut after two
    theirs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    match = transformers_baseline.greedy_agreement(ours, theirs)
    assert match["identical"] == pytest.approx(1 / 3)
    assert match["mean_common_prefix"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert [transformers_baseline.first_difference(a, b) for a, b in zip(ours, theirs, strict=True)] == [
        None,
        2,
        None,
    ]


def test_a_unary_run_counts_its_tokens_at_the_response_and_measures_no_latency_between_them() -> None:
    spec = serving.WorkloadSpec("random", 3, 16, 2)
    results = [
        serving.RequestResult(0, 16, sent=1.0, last_token=1.5, token_ids=[5, 6], streamed=False),
        serving.RequestResult(1, 16, sent=1.0, last_token=3.0, token_ids=[7, 8], streamed=False),
        serving.RequestResult(2, 16, sent=1.0, error="UNAVAILABLE: gone", streamed=False),
    ]
    summary = serving.summarize("duoserve", "dtype=bfloat16", "bfloat16", spec, serving.UNARY_MODE, results)
    assert (summary.completed, summary.errors, summary.output_tokens) == (2, 1, 4)
    assert summary.wall_s == pytest.approx(2.0) and summary.output_tok_s == pytest.approx(2.0)
    assert summary.ttft_p50 is None and summary.tpot_p50 is None
    assert (summary.e2e_p50, summary.e2e_p99) == pytest.approx((1.25, 1.985))
    # A streamed request that never saw a token is not counted as one that did.
    silent = serving.RequestResult(0, 16, sent=1.0, last_token=2.0, token_ids=[5])
    assert serving.summarize("duoserve", "c", "bfloat16", spec, "offline", [silent]).output_tokens == 0


def test_the_transformers_ratio_is_taken_for_the_streamed_and_the_unary_offline_runs() -> None:
    streamed, unary, at_rate = (_run("dtype=bfloat16", "random", 0, tok_s) for tok_s in (300.0, 330.0, 200.0))
    unary.mode, at_rate.mode = serving.UNARY_MODE, "poisson@2/s"
    theirs = _run("transformers", "random", 0, 100.0)
    theirs.engine = "transformers"
    rows = serving.ratios([streamed, unary, at_rate, theirs])
    assert [(row["mode"], row["ratio"]) for row in rows] == [
        ("offline", pytest.approx(3.0)),
        (serving.UNARY_MODE, pytest.approx(3.3)),
    ]


def test_sampling_settings_are_parsed_by_name_and_type() -> None:
    assert serving.parse_sampling("") == {}
    assert serving.parse_sampling("temperature=0.8,top_p=0.95,top_k=50") == {
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 50,
    }
    with pytest.raises(ValueError, match="--sampling: 'seed=3'; use K=V with K one of temperature"):
        serving.parse_sampling("seed=3")
    with pytest.raises(ValueError, match=r"--sampling: top_k='0.5' is not an integer"):
        serving.parse_sampling("top_k=0.5")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sampling", "temperature=0.8", "--transformers"], "comparison with transformers is of greedy"),
        (["--sampling", "temp=0.8"], "--sampling: 'temp=0.8'"),
    ],
)
def test_bad_sampling_is_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        serving.main(argv)
    assert message in capsys.readouterr().err

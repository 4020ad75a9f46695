"""Sampler semantics on small hand-made logits, with exact expectations."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker import sampler
from gpu_worker.sampler import (
    DRAW_BLOCK,
    Sampler,
    SamplingParams,
    SamplingRow,
    apply_penalties,
    filtered_probs,
    filtered_weights,
    row_seed,
)


def _rows(params: list[SamplingParams], output: list[int] | None = None) -> list[SamplingRow]:
    return [SamplingRow(p, prompt_token_ids=[], output_token_ids=list(output or [])) for p in params]


def test_greedy_is_argmax_of_raw_logits() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0).sample(logits, _rows([SamplingParams()] * 6))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_in_the_models_dtype_sample_as_their_float32_copy(dtype: torch.dtype) -> None:
    """The model hands the sampler its head's dtype: greedy rows take the argmax of those logits
    as they are; penalties, draws and logprobs work on float32 copies. Every path gives what the
    float32 logits (the same values) give: the same tokens, and logprobs to float32's rounding
    (bfloat16 logits' go to the C kernel, which sums in float64)."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 4099, generator=gen) * 3).to(dtype)
    logits[1, 100:140] = logits[1].max()  # a tie: the first index wins
    wide = logits.float()
    log_softmax = torch.log_softmax(wide, dim=-1)
    history = list(range(0, 4000, 7))
    batches = [
        [SamplingParams()] * 5,  # all greedy: the direct argmax
        [SamplingParams(repetition_penalty=1.5, logprobs=3)] * 5,
        [SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=3)] * 2
        + [SamplingParams(logprobs=0)],
    ]
    for params in batches:
        rows = [SamplingRow(p, [1, 2], history) for p in params]
        ours, reference = Sampler(seed=1).sample(logits, rows), Sampler(seed=1).sample(wide, rows)
        assert ours.token_ids == reference.token_ids
        for row, (mine, theirs) in enumerate(zip(ours.logprobs, reference.logprobs, strict=True)):
            assert (mine is None) == (theirs is None)
            if mine is not None and theirs is not None:
                values = [mine.logprob, *mine.top_logprobs]
                torch.testing.assert_close(
                    values, [theirs.logprob, *theirs.top_logprobs], rtol=1e-6, atol=1e-6
                )
                # Tied tokens (bfloat16 logits tie often) may come in another order, or another of
                # them (the kernel takes them by token id): each token carries its own value.
                assert len(set(mine.top_token_ids)) == len(mine.top_token_ids)
                tops = log_softmax[row, mine.top_token_ids].tolist()
                torch.testing.assert_close(mine.top_logprobs, tops, rtol=1e-6, atol=1e-6)
    assert Sampler().sample(logits, _rows([SamplingParams()] * 5)).token_ids[1] == 100


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=temperature, top_k=1)] * 8
    sampler = Sampler(seed=1)
    for _ in range(5):
        assert sampler.sample(logits, _rows(params)).token_ids == logits.argmax(dim=-1).tolist()


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = SamplingRow(
        SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1], output_token_ids=[1, 3]
    )
    scores = apply_penalties(logits, [row])
    torch.testing.assert_close(scores, torch.tensor([[1.0, -2.0, 0.5, 1.5, -2.0]]), rtol=0, atol=0)
    assert logits[0, 0] == 2.0, "the raw logits must stay untouched"


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(2, 4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    rows = [
        SamplingRow(params, prompt_token_ids=[0, 0, 0], output_token_ids=[1, 1, 1, 2]),
        SamplingRow(SamplingParams(), prompt_token_ids=[1], output_token_ids=[1]),  # no penalties
    ]
    scores = apply_penalties(logits, rows)
    expected = torch.tensor([[0.0, -(0.5 + 3 * 0.25), -(0.5 + 0.25), 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)


def test_penalised_greedy_avoids_repeated_token() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    row = SamplingRow(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0], output_token_ids=[])
    assert Sampler().sample(logits, [row]).token_ids == [1]  # 5 / 2 = 2.5 < 4


def test_top_p_and_min_p_never_pick_filtered_tokens(top_p_path: str) -> None:
    # probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 (plus a far tail)
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625 - 1e-6, 1e-6])
    logits = probs.log()[None, :].repeat(3, 1)
    params = [
        SamplingParams(temperature=1.0, top_p=0.7),  # keeps {0, 1}: 0.5 < 0.7 ≤ 0.75
        SamplingParams(temperature=1.0, min_p=0.3),  # keeps p ≥ 0.15: {0, 1}
        SamplingParams(temperature=1.0, top_k=3, top_p=0.8),  # top-3 renormalised: .571 .286 .143 → {0, 1}
    ]
    kept = filtered_probs(logits, params) > 0
    assert kept.tolist() == [[True, True, False, False, False, False]] * 3
    sampler = Sampler(seed=3)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(400):
        for i, token in enumerate(sampler.sample(logits, _rows(params)).token_ids):
            seen[i].add(token)
    assert seen == [{0, 1}] * 3


def test_unfiltered_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None, :].repeat(2000, 1)
    tokens = Sampler(seed=4).sample(logits, _rows([SamplingParams(temperature=1.0)] * 2000)).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 2000
    torch.testing.assert_close(freq, probs, atol=0.04, rtol=0)


SEEDED_VARIANTS = [
    SamplingParams(temperature=1.0, seed=1234),
    SamplingParams(temperature=0.7, seed=99, top_k=40),
    SamplingParams(temperature=1.3, seed=7, top_p=0.9),
    SamplingParams(temperature=1.0, seed=2**40, top_k=300, top_p=0.8, min_p=0.01),
]


@pytest.mark.parametrize("params", SEEDED_VARIANTS)
def test_seeded_row_is_independent_of_batch_and_repeats_on_recompute(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(5)
    target = torch.randn(1, 2000, generator=gen) * 2
    seeded = SamplingRow(params, prompt_token_ids=[1, 2], output_token_ids=[7, 8])
    alone = Sampler().sample(target, [seeded]).token_ids[0]
    for trial in range(4):
        others = torch.randn(2 + trial, 2000, generator=gen) * 2
        batch = torch.cat([others[:2], target, others[2:]])
        rows = _rows([SamplingParams(temperature=0.8, top_k=50 + 600 * trial, top_p=0.9)] * (2 + trial))
        rows.insert(2, seeded)
        assert Sampler(seed=trial).sample(batch, rows).token_ids[2] == alone
    # A different output index is a different draw: over many indices the tokens vary.
    draws = {
        Sampler().sample(target, [SamplingRow(params, [1, 2], list(range(n)))]).token_ids[0]
        for n in range(30)
    }
    assert len(draws) > 3


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(logprobs=0),
        SamplingParams(temperature=2.0, repetition_penalty=3.0, logprobs=4),
        SamplingParams(),
    ]
    rows = [SamplingRow(p, [0, 1, 2], [3]) for p in params]
    out = Sampler(seed=6).sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert third is None
    assert first is not None and first.top_token_ids == [] and first.top_logprobs == []
    assert math.isclose(first.logprob, reference[0, out.token_ids[0]].item(), rel_tol=1e-6)
    assert second is not None
    assert math.isclose(second.logprob, reference[1, out.token_ids[1]].item(), rel_tol=1e-6)
    values, ids = reference[1].topk(4)
    assert second.top_token_ids == ids.tolist()
    torch.testing.assert_close(torch.tensor(second.top_logprobs), values)


def test_bfloat16_logprobs_on_the_cpu_match_torchs() -> None:
    """bfloat16 logits take the C kernel: the same values as torch's float32 log_softmax to its
    rounding, the same top tokens (these rows have no ties among their best)."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 4000, generator=gen) * 4).to(torch.bfloat16)
    logits[:, :8] = torch.arange(30, 22, -1, dtype=torch.bfloat16)  # distinct best tokens
    params = [SamplingParams(temperature=0.7, logprobs=n, seed=n) for n in (0, 1, 3, 8, 5, 2)]
    rows = [SamplingRow(p, [0, 1, 2], []) for p in params]
    out = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert entry is not None
        n = params[i].logprobs or 0
        assert math.isclose(entry.logprob, reference[i, out.token_ids[i]].item(), abs_tol=1e-4)
        values, ids = reference[i].topk(n)
        assert entry.top_token_ids == ids.tolist() == list(range(n))
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), values, atol=1e-4, rtol=0)


def _reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Straightforward full-sort top-k → top-p → min-p on one row of scores."""
    order = row.argsort(descending=True).tolist()
    if p.top_k > 0:
        order = order[: p.top_k]
    probs = torch.softmax(row[order], dim=0)
    kept, mass = [], 0.0
    for token, prob in zip(order, probs.tolist(), strict=True):
        if p.top_p < 1.0 and mass >= p.top_p:
            break
        kept.append((token, prob))
        mass += prob
    best = max(prob for _, prob in kept)
    return {token for token, prob in kept if prob >= p.min_p * best}


@pytest.fixture(params=["draw kernel", "ranked", "ranked whole"])
def top_p_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Sampled rows on the CPU are drawn by the C kernel; without the CPU kernels, top-k and top-p
    rows rank their best tokens, a top-p row as many as its mass needs, and on a GPU the whole
    vocabulary (here: no widths to try). Tests that take this fixture run all three ways."""
    if request.param == "draw kernel":
        assert sampler._cpu_bfloat16_ops() is not None, "the CPU fused ops did not build here"
    else:
        monkeypatch.setattr(sampler, "_cpu_bfloat16_ops", lambda: None)
    if request.param == "ranked whole":
        monkeypatch.setattr(sampler, "TOP_P_WIDTHS", ())
    return str(request.param)


@pytest.mark.parametrize("spread", [0.5, 4.0])  # flat rows need the full sort, peaked ones do not
def test_filtering_matches_full_sort_reference(spread: float, top_p_path: str) -> None:
    vocab = 3000  # more than the top-p first guess of candidates
    scores = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * spread
    scores = scores.float()
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.5),
        SamplingParams(temperature=1.0),
    ]
    probs = filtered_probs(scores, params)
    for i, p in enumerate(params):
        kept = set(torch.nonzero(probs[i]).flatten().tolist())
        assert kept == _reference_kept(scores[i], p), f"row {i}: {p}"
        torch.testing.assert_close(
            probs[i].sum(), torch.tensor(1.0), atol=1e-5, rtol=0
        ) if p.min_p == 0 else None


@pytest.mark.gpu
def test_penalised_and_filtered_sampling_on_cuda_does_not_wait_for_the_device() -> None:
    """On a GPU, choose() queues its work behind the step's and returns: the runner copies the
    tokens back asynchronously and launches the next step meanwhile. Rows here use every penalty
    and every filter (top-k with top-p, min-p, top-p alone), with top_k=1 or a top-p that keeps
    only the best token so the tokens are exact; they must equal the CPU's, and choose() must
    return while matrix multiplies queued before it still run (a host-to-device copy without pinned
    memory, or a value read back, would wait for them)."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 3000, generator=gen)
    history = [int(i) for i in torch.randint(0, 3000, (40,), generator=gen)]
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.4),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3),
        SamplingParams(temperature=1.5, top_k=1, frequency_penalty=1.0),
        SamplingParams(temperature=0.9, top_p=1e-6, seed=5),  # the best token holds more: it alone is kept
    ]
    rows = [SamplingRow(p, prompt_token_ids=history[:20], output_token_ids=history[20:]) for p in params]
    expected = Sampler(seed=0).choose(logits, rows)
    sampler = Sampler(seed=0)
    on_device = logits.to(device)
    sampler.choose(on_device, rows)  # first use: generators, the pinned-memory pool
    busy = torch.randn(4096, 4096, device=device)
    end = torch.cuda.Event()
    torch.cuda.synchronize()
    for _ in range(20):
        torch.mm(busy, busy)
    end.record()
    chosen = sampler.choose(on_device, rows)
    still_busy = not end.query()
    assert still_busy, "choose() waited for the matrix multiplies queued before it"
    assert chosen.device.type == "cuda"
    assert chosen.cpu().tolist() == expected.tolist()


def _inverse_cdf_reference(scores: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Each seeded row's draw as the module docstring defines it: the first token whose running
    total of filtered weights (over the whole vocabulary, in token-id order) passes its uniform
    times the total, the uniform from the row's own seeded generator."""
    tokens = []
    for i, row in enumerate(rows):
        p = row.params
        assert p.seed is not None
        gen = torch.Generator().manual_seed(row_seed(p.seed, len(row.output_token_ids)))
        uniform = torch.rand((), generator=gen)
        weights = filtered_weights(scores[i : i + 1] / p.temperature, [p])[0]
        running = weights.cumsum(dim=0)
        tokens.append(int(torch.searchsorted(running, uniform * running[-1], right=True)))
    return tokens


@pytest.mark.parametrize("vocab", [DRAW_BLOCK * 3 + 37, 700])  # whole blocks and a partial one; one block
def test_a_draw_is_the_inverse_of_the_filtered_cumulative_distribution(vocab: int, top_p_path: str) -> None:
    """Draws sum only what they need: whole-vocabulary rows the block their target falls in, ranked
    rows their candidates (as wide as top_p needs, row by row). The token is still the one the
    whole vocabulary's running total gives, row by row, whatever else is in the batch."""
    gen = torch.Generator().manual_seed(11)
    spreads = [4.0, 1.5, 0.3, 0.05] * 3  # peaked to flat: nuclei of a few tokens to most of them
    scores = torch.cat([torch.randn(1, vocab, generator=gen) * s for s in spreads])
    scores[5, 0] = scores[5].max() + 1.0  # token 0 among a row's candidates, as padding's ids are
    params = [
        SamplingParams(temperature=t, top_p=0.9, seed=n) if n < 4 else SamplingParams(temperature=t, seed=n)
        for n, t in enumerate([1.0, 0.7, 1.3, 1.0])
    ]
    params += [
        SamplingParams(temperature=1.0, min_p=0.3, seed=4),
        SamplingParams(temperature=0.9, top_k=7, seed=5),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.5, seed=6),
        SamplingParams(temperature=2.0, top_p=0.99, min_p=0.01, seed=7),
    ]
    params += [SamplingParams(temperature=1.0, seed=8 + n) for n in range(4)]
    for step in range(20):
        rows = [SamplingRow(p, [1, 2], list(range(step))) for p in params]
        expected = _inverse_cdf_reference(scores, rows)
        assert Sampler().sample(scores, rows).token_ids == expected
        # Peaked ranked rows alone: a few candidates each, put in token-id order (above, a flat
        # top-p row's candidates span most of the vocabulary, summed in place).
        narrow = [0, 5, 6]
        alone = Sampler().sample(scores[narrow], [rows[i] for i in narrow]).token_ids
        assert alone == [expected[i] for i in narrow]

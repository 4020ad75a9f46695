"""Token sampling for one step, vectorised over the batch.

Order of operations per row: repetition penalty (HF style, prompt + output tokens), presence and
frequency penalties (OpenAI style, output tokens only), then greedy argmax when temperature is 0,
else temperature, top-k, top-p, min-p and a draw. Logprobs always describe the raw model logits.

A draw inverts the row's cumulative distribution (in token-id order) at one uniform number. A
seeded row takes that number from a generator seeded with (seed, number of tokens already
generated), so its token depends on nothing else in the batch and repeats exactly when the step is
recomputed. (One uniform per row instead of an exponential race's one per vocabulary entry:
drawing 3M exponentials costs more than the forward pass on a CPU.)

On the CPU one C call draws every sampled row of a step (CpuFusedOps.draw): it finds a row's top-k
and top-p nucleus without ranking the row (after a flat distribution a nucleus spans thousands of
tokens, and ranking 64 such rows added about 60 ms to a decode step of 69), and reads each row a
few times instead of writing out its temperature, weights and filters as tensors. Its top-k keeps
every token tied with the k-th, as the ranked path's torch.topk does not.

Elsewhere (on a GPU, or without a C compiler) a row with top-k or top-p draws among its ranked
candidates alone, put in token-id order: the same partial sums, bit for bit, as the whole
vocabulary's with the filtered tokens at zero (a cumulative sum adds in order, and zeros change
nothing). Any other row finds the block of DRAW_BLOCK tokens its target falls in from the blocks'
sums, then the token within that block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.streams import to_device
from kernels.cpu_build import KernelBuildError
from kernels.cpu_fused import CpuFusedOps, load_cpu_fused_ops

_MASK64 = (1 << 64) - 1
# How many ranked tokens a top-p row without top-k takes on a CPU without the draw kernel (no C
# compiler): the first width, then for the rows whose candidates hold less than top_p of the mass
# the next, and so on, then the whole vocabulary. (A GPU ranks the whole vocabulary at once: one
# sort, where checking a width would wait for the device.)
# SmolLM2's next-token logits for 64 chat prompts (bench/sampler.py, 384 rows) held their nucleus
# within 64 tokens in 99% of rows at temperature 0.7 and top-p 0.9, in 93% at 0.8 and 0.95, in 65%
# at 1.0 and 0.95 (within 512 in 96%); at 1.3 and 0.99 within 4096 in 69%. On a 2-core CPU,
# ranking 64 rows of 49152 tokens took 3.4 ms for 64 of them, 15 ms for 1024, 20 ms for 4096 and
# 83 ms for all.
TOP_P_WIDTHS = (64, 512, 4096)
DRAW_BLOCK = 1024  # tokens per block of a whole-vocabulary draw


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings (validated by the scheduler, not here)."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # None: not requested; 0: the chosen token's only; n: also the top n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class SamplingRow:
    """One logits row's request settings and token history."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the chosen token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def row_seed(seed: int, step: int) -> int:
    """64-bit generator seed for a seeded row's draw number `step` (= tokens already generated)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed ^= mixed >> 31
    return (mixed * 0x94D049BB133111EB) & _MASK64


class Sampler:
    """Turns a step's logits into tokens; owns the generator used by unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Pick one token per row of `logits` ([S, V], the model's dtype)."""
        if not rows:
            return SamplerOutput([], [])
        chosen = self.choose(logits, rows)
        return SamplerOutput(chosen.tolist(), compute_logprobs(logits, chosen, [r.params for r in rows]))

    def choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:  # [S] int64
        """The chosen tokens as a tensor on the logits' device. Nothing waits for the device, so on
        a GPU the step's tokens can be copied back asynchronously.

        Greedy rows without penalties take the argmax of `logits` as they are (float32 holds every
        bfloat16 and float16 value, so converting first would not change it); anything else works
        on a float32 copy."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        assert logits.is_floating_point(), f"logits must be floating point, got {logits.dtype}"
        params = [r.params for r in rows]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows and not any(_penalized(p) for p in params):
            return _argmax(logits)
        scores = apply_penalties(logits.float(), rows)  # [S, V]
        if not random_rows:
            chosen = _argmax(scores)
        elif len(random_rows) == len(rows):
            chosen = self._draw(scores, rows)
        else:
            chosen = _argmax(scores)
            index = to_device(random_rows, logits.device)
            picked = self._draw(scores.index_select(0, index), [rows[i] for i in random_rows])
            chosen = chosen.index_copy(0, index, picked)
        return chosen

    def _draw(self, scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:  # [R] int64
        """One draw per row of `scores` (float32, before temperature)."""
        params = [r.params for r in rows]
        uniforms = self._uniforms(rows, scores.device)  # [R] in [0, 1)
        ops = _cpu_bfloat16_ops() if scores.device.type == "cpu" else None
        if ops is not None:
            vocab = scores.shape[1]
            return ops.draw(
                scores.contiguous(),
                torch.tensor([p.temperature for p in params], dtype=torch.float32),
                torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=torch.int64),
                torch.tensor([p.top_p for p in params], dtype=torch.float32),
                torch.tensor([p.min_p for p in params], dtype=torch.float32),
                uniforms,
            )
        ranked = _ranked_rows(scores, params)
        if not ranked:
            return _draw_whole(scores, params, uniforms)
        if len(ranked) == len(params):
            return _draw_ranked(scores, params, uniforms)
        chosen = torch.empty(len(params), dtype=torch.int64, device=scores.device)
        ranked_set = set(ranked)
        whole = [i for i in range(len(params)) if i not in ranked_set]
        for subset, draw in ((ranked, _draw_ranked), (whole, _draw_whole)):
            index = to_device(subset, scores.device)
            picked = draw(scores.index_select(0, index), [params[i] for i in subset], uniforms[index])
            chosen.index_copy_(0, index, picked)
        return chosen

    def _uniforms(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:  # [R] in [0, 1)
        values = torch.rand(len(rows), generator=self._generator(device), device=device)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(row.params.seed, len(row.output_token_ids)))
                values[i] = torch.rand((), generator=gen, device=device)
        return values

    def reset(self) -> None:
        """Draw as a new sampler would: the generators start again from the seed (after warm-up)."""
        self._generators.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:  # [S, V]
    """Repetition (prompt + output), presence and frequency (output) penalties; `logits` is untouched.

    Work is proportional to the history lengths: only the (row, token) entries that occur are read
    and rewritten, never a dense [S, V] mask.
    """
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    additive = [i for i, r in enumerate(rows) if _additive_penalty(r.params)]
    if not rep and not additive:
        return logits
    vocab = logits.shape[1]
    scores = logits.clone()
    flat = scores.view(-1)  # entry (row, token) at row * V + token
    if rep:
        history = [(i, rows[i].prompt_token_ids) for i in rep] + [(i, rows[i].output_token_ids) for i in rep]
        seen = np.unique(_flat_indices(history, vocab))  # each occurring entry once
        penalty = np.array([r.params.repetition_penalty for r in rows], dtype=np.float32)[seen // vocab]
        index, factor = to_device(seen, scores.device), to_device(penalty, scores.device)
        values = flat[index]
        flat[index] = torch.where(values > 0, values / factor, values * factor)
    if additive:
        occurrences = _flat_indices([(i, rows[i].output_token_ids) for i in additive], vocab)
        distinct = np.unique(occurrences)
        presence = np.array([r.params.presence_penalty for r in rows], dtype=np.float32)
        frequency = np.array([r.params.frequency_penalty for r in rows], dtype=np.float32)
        # presence once per distinct token, frequency once per occurrence
        flat.index_add_(
            0, to_device(distinct, scores.device), to_device(-presence[distinct // vocab], scores.device)
        )
        flat.index_add_(
            0,
            to_device(occurrences, scores.device),
            to_device(-frequency[occurrences // vocab], scores.device),
        )
    return scores


def _additive_penalty(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _penalized(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or _additive_penalty(params)


def _flat_indices(lists: Sequence[tuple[int, Sequence[int]]], vocab: int) -> np.ndarray:  # [N] int64
    arrays = [np.asarray(ids, dtype=np.int64) for _, ids in lists]
    rows = np.repeat(np.array([row for row, _ in lists], dtype=np.int64), [a.size for a in arrays])
    return rows * vocab + np.concatenate([*arrays, np.empty(0, np.int64)])


def _argmax(x: torch.Tensor) -> torch.Tensor:  # [R, V] → [R]
    """Each row's first largest entry. bfloat16 rows on the CPU go to the C kernel, which reads
    them once in place (~5x faster than converting them and taking torch's max); otherwise torch's
    max, which has the same first-index tie rule as argmax and is several times faster on the CPU."""
    ops = _ops_reading(x)
    if ops is not None:
        return ops.argmax(x.contiguous())
    return x.max(dim=-1).indices


_cpu_ops: list[CpuFusedOps | None] = []  # empty until first asked for


def _ops_reading(x: torch.Tensor) -> CpuFusedOps | None:
    """The CPU fused ops where they can read `x` in place (bfloat16 rows on the CPU), else None."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[-1] > 0:
        return _cpu_bfloat16_ops()
    return None


def _cpu_bfloat16_ops() -> CpuFusedOps | None:
    """The CPU fused ops for bfloat16, or None where they cannot be built (no compiler)."""
    if not _cpu_ops:
        try:
            _cpu_ops.append(load_cpu_fused_ops(torch.bfloat16))
        except KernelBuildError:
            _cpu_ops.append(None)
    return _cpu_ops[0]


def filtered_probs(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, V]
    """Softmax after top-k, top-p and min-p filtering (filtered tokens get probability 0)."""
    weights = filtered_weights(scores, params)
    return weights / weights.sum(dim=-1, keepdim=True)


def filtered_weights(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, V]
    """exp(score - row max) after top-k, top-p and min-p filtering; 0 where filtered, 1 for the best
    token: the weights a draw inverts (`scores` at temperature). The torch path's draws take them
    from the same helpers without writing them out whole; the CPU's draw kernel applies the same
    filters (but keeps every token tied with top-k's k-th)."""
    ranked = _ranked_rows(scores, params)
    if not ranked:
        return _whole_weights(scores, params)
    weights = torch.empty_like(scores)
    ranked_set = set(ranked)
    whole = [i for i in range(len(params)) if i not in ranked_set]
    if whole:
        index = to_device(whole, scores.device)
        weights.index_copy_(0, index, _whole_weights(_rows(scores, whole), [params[i] for i in whole]))
    index = to_device(ranked, scores.device)
    ranked_params = [params[i] for i in ranked]
    kept, ids = _candidates(_rows(scores, ranked), ranked_params)
    # scatter_add_: the ids past a row's own candidates are 0s of weight 0, beside a real token 0.
    dense = torch.zeros(len(ranked), scores.shape[1], device=scores.device).scatter_add_(1, ids, kept)
    weights.index_copy_(0, index, _min_p(dense, ranked_params))
    return weights


def _ranked_rows(scores: torch.Tensor, params: Sequence[SamplingParams]) -> list[int]:  # [R, V]
    """The rows that draw among their ranked best tokens: those with a top-k below the vocabulary
    or a top-p (where the CPU's draw kernel is not to be had)."""
    vocab = scores.shape[1]
    return [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]


def _whole_weights(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, V]
    """exp(score - row max) for rows that are not ranked (`scores` at temperature), 0 below min-p."""
    return _min_p(_relative_exp(scores), params)


def _relative_exp(scores: torch.Tensor) -> torch.Tensor:  # [R, V]
    return (scores - scores.amax(dim=-1, keepdim=True)).exp_()


def _min_p(weights: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, N]
    """Weights below the row's min_p set to 0, in place. The best token weighs 1, so min_p is
    directly the weight threshold (relative, so renormalisation after top-k/top-p does not matter)."""
    if not any(p.min_p > 0 for p in params):
        return weights
    min_p = to_device([p.min_p for p in params], weights.device)
    return weights.masked_fill_(weights < min_p[:, None], 0.0)


def _at_temperature(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, V]
    return scores / to_device([p.temperature for p in params], scores.device)[:, None]


def _draw_whole(
    scores: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Rows that are not ranked ([R, V] before temperature): the block whose running total first
    passes the row's target (its uniform times the total weight), then the token in that block."""
    weights = _whole_weights(_at_temperature(scores, params), params)  # [R, V]
    rows, vocab = weights.shape
    blocks = -(-vocab // DRAW_BLOCK)
    whole = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = weights[:, :whole].reshape(rows, -1, DRAW_BLOCK).sum(dim=-1)  # [R, whole blocks]
    if whole < vocab:
        sums = torch.cat([sums, weights[:, whole:].sum(dim=-1, keepdim=True)], dim=1)  # [R, blocks]
    running = sums.cumsum(dim=-1)  # [R, blocks]
    targets = uniforms * running[:, -1]  # [R]
    block = torch.searchsorted(running, targets[:, None], right=True).clamp_max_(blocks - 1)  # [R, 1]
    before = torch.where(block > 0, running.gather(1, (block - 1).clamp_min(0)), 0.0)  # [R, 1]
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)  # [R, DRAW_BLOCK]
    inside = weights.gather(1, columns.clamp_max(vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    offset = torch.searchsorted(inside.cumsum(dim=-1), targets[:, None] - before, right=True)
    picked = columns.gather(1, offset.clamp_max_(DRAW_BLOCK - 1))[:, 0].clamp_max_(vocab - 1)
    return _valid_or_best(weights, picked)


def _draw_ranked(
    scores: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Ranked rows ([R, V] before temperature): a draw over the kept candidates in token-id order,
    the first whose running total passes the row's target."""
    scores = _at_temperature(scores, params)
    kept, ids = _candidates(scores, params)  # [R, K] each, best first
    kept = _min_p(kept, params)
    rows, vocab = scores.shape
    if kept.shape[1] * 8 <= vocab:
        ids, order = ids.sort(dim=-1)
        kept = kept.gather(1, order)
    else:  # the candidates' ids would take longer to sort than the whole vocabulary to sum
        kept = torch.zeros_like(scores).scatter_add_(1, ids, kept)  # [R, V]: 0s of ids past a row's own add 0
        ids = torch.arange(vocab, device=scores.device).expand(rows, vocab)
    running = kept.cumsum(dim=-1)  # [R, K]
    targets = uniforms * running[:, -1]  # [R]
    at = torch.searchsorted(running, targets[:, None], right=True).clamp_max_(kept.shape[1] - 1)  # [R, 1]
    # Zero-weight tokens never raise the running total, so they are never first past the target;
    # only rounding at the very top can run off the end, where the likeliest token stands in.
    valid = kept.gather(1, at)[:, 0] > 0
    picked = ids.gather(1, at)[:, 0]
    if scores.device.type == "cpu" and bool(valid.all()):
        return picked
    return torch.where(valid, picked, ids.gather(1, kept.max(dim=-1).indices[:, None])[:, 0])


def _valid_or_best(weights: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:  # [R]
    """`picked` where its weight is positive, else the row's likeliest token (rounding at the very
    top of a running total can step past the last token with weight)."""
    valid = weights.gather(1, picked[:, None])[:, 0] > 0
    # Reading `valid` back would wait for a GPU's queued work; on the CPU it is free and saves the
    # fallback's argmax.
    if weights.device.type == "cpu" and bool(valid.all()):
        return picked
    return torch.where(valid, picked, _argmax(weights))


def _candidates(
    scores: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, K] float32 and int64
    """Each row's best tokens, best first, with exp(score - row max) where top-k and top-p keep
    them and 0 where not (and past the row's own candidates, where its ids are 0). A row with top-k
    ranks as many as the largest top-k among them. A top-p row without ranks, on the CPU, as many
    as its mass needs (TOP_P_WIDTHS, each width's masses read on the host); on a GPU, the whole
    vocabulary at once, so that nothing waits for the device."""
    vocab = scores.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_ps = [p.top_p for p in params]
    has_top_k = [k < vocab for k in ks]  # a top-k of the whole vocabulary or more keeps every token
    parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # rows, their scores and ids
    cut = [i for i, top_k in enumerate(has_top_k) if top_k]
    if cut:
        top_scores, top_ids = _rows(scores, cut).topk(max(ks[i] for i in cut), dim=-1)  # sorted
        parts.append((cut, top_scores, top_ids))
    # A top-p-only row's top_p is a share of the whole vocabulary's mass, not the candidates'.
    full_lse = torch.zeros(len(params), device=scores.device)
    pending = [i for i, top_k in enumerate(has_top_k) if not top_k]
    if pending:
        full_lse.index_copy_(0, to_device(pending, scores.device), _rows(scores, pending).logsumexp(dim=-1))
    widths = [w for w in TOP_P_WIDTHS if w < vocab] if scores.device.type == "cpu" else []
    for width in [*widths, vocab]:
        if not pending:
            break
        top_scores, top_ids = _rows(scores, pending).topk(width, dim=-1)  # sorted
        if width == vocab:
            parts.append((pending, top_scores, top_ids))
            break
        lse = full_lse.index_select(0, to_device(pending, scores.device))
        mass = (top_scores - lse[:, None]).exp().sum(dim=-1).tolist()
        enough = [j for j, row in enumerate(pending) if mass[j] >= top_ps[row]]
        if enough:
            index = to_device(enough, scores.device)
            parts.append(([pending[j] for j in enough], top_scores[index], top_ids[index]))
        pending = [row for j, row in enumerate(pending) if mass[j] < top_ps[row]]
    top_scores, top_ids = _assemble(len(params), parts, scores.device)
    keep = _top_k_top_p_keep(top_scores, ks, top_ps, has_top_k, full_lse)  # [R, K]
    kept = (top_scores - top_scores[:, :1]).exp_().masked_fill_(~keep, 0.0)
    return kept, top_ids


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of `x` at these positions (x itself where they are all of them, in order)."""
    if rows == list(range(x.shape[0])):
        return x
    return x.index_select(0, to_device(rows, x.device))


def _assemble(
    num_rows: int, parts: Sequence[tuple[list[int], torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [R, K] float32 and int64
    """Rows of candidates of several widths in one tensor, each padded with -inf scores (id 0)."""
    if len(parts) == 1 and parts[0][0] == list(range(num_rows)):  # every row, in order
        return parts[0][1], parts[0][2]
    width = max(top_scores.shape[1] for _, top_scores, _ in parts)
    all_scores = torch.full((num_rows, width), float("-inf"), device=device)
    all_ids = torch.zeros(num_rows, width, dtype=torch.int64, device=device)
    for rows, top_scores, top_ids in parts:
        index = to_device(rows, device)
        all_scores[:, : top_scores.shape[1]].index_copy_(0, index, top_scores)
        all_ids[:, : top_ids.shape[1]].index_copy_(0, index, top_ids)
    return all_scores, all_ids


def _top_k_top_p_keep(
    top_scores: torch.Tensor,  # [Rk, K] descending
    ks: Sequence[int],
    top_ps: Sequence[float],
    has_top_k: Sequence[bool],
    full_lse: torch.Tensor,  # [Rk] logsumexp over the whole vocabulary
) -> torch.Tensor:  # [Rk, K] bool
    device = top_scores.device
    rank = torch.arange(top_scores.shape[1], device=device)[None, :]  # [1, K]
    keep = rank < to_device(ks, device)[:, None]
    if any(p < 1.0 for p in top_ps):
        top_p = to_device(top_ps, device)[:, None]  # [Rk, 1]
        kept = top_scores.masked_fill(~keep, float("-inf"))
        # With top-k, top-p sees the distribution renormalised over the top-k survivors.
        lse = torch.where(to_device(has_top_k, device), kept.logsumexp(dim=-1), full_lse)
        probs = (kept - lse[:, None]).exp()  # [Rk, K]
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        keep &= mass_before < top_p  # always keeps rank 0
    return keep


def compute_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """log_softmax of the raw logits: the chosen token's value and, when asked, the top n.
    bfloat16 logits on the CPU go to the C kernel (CpuFusedOps.logprobs), which reads each row in
    place instead of writing its log_softmax out: for 64 rows of SmolLM2's logits with the top 5,
    1.8 ms against torch's 6.0 on a 2-core CPU. Its ties in the top n come in token-id order."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return [None] * len(params)
    index = to_device(wanted, logits.device)
    top_n = min(max(params[i].logprobs or 0 for i in wanted), logits.shape[1])
    ops = _ops_reading(logits)
    if ops is not None:
        chosen_lp, values, ids = ops.logprobs(_rows(logits, wanted).contiguous(), chosen[index], top_n)
    else:
        logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [W, V] float32
        chosen_lp = logprobs.gather(1, chosen.index_select(0, index)[:, None])[:, 0]
        values, ids = logprobs[:, :0], torch.empty(len(wanted), 0, dtype=torch.int64)
        if top_n > 0:
            values, ids = logprobs.topk(top_n, dim=-1)
    chosen_values, top_lp, top_ids = chosen_lp.tolist(), values.tolist(), ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(wanted):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen_values[j], top_ids[j][:n], top_lp[j][:n])
    return out

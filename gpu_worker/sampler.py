"""Token sampling for one step, vectorised over the batch.

Order of operations per row: repetition penalty (HF style, prompt + output tokens), presence and
frequency penalties (OpenAI style, output tokens only), then greedy argmax when temperature is 0,
else temperature, top-k, top-p, min-p and a draw. Logprobs always describe the raw model logits.

A draw inverts the row's cumulative distribution (over the whole vocabulary, in token-id order)
at one uniform number. A seeded row takes that number from a generator seeded with (seed, number
of tokens already generated), so its token depends on nothing else in the batch and repeats
exactly when the step is recomputed. (One uniform per row instead of an exponential race's one
per vocabulary entry: drawing 3M exponentials costs more than the forward pass on a CPU.)
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
TOP_P_CANDIDATES = 1024  # first guess at how many ranked tokens a top-p-only row needs


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
        """The chosen tokens as a tensor on the logits' device. Nothing waits for the device (so on
        a GPU the step's tokens can be copied back asynchronously) except a row with top-p and no
        top-k, whose first guess of candidates is checked on the host (see filtered_weights).

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
        temps = to_device([r.params.temperature for r in rows], scores.device)
        weights = filtered_weights(scores / temps[:, None], [r.params for r in rows])  # [R, V]
        # Unnormalised on purpose: every weight is computed elementwise from the row's own scores,
        # so a seeded row's cdf has the same bits whatever else is in the batch.
        cdf = weights.cumsum(dim=-1)  # [R, V]
        targets = self._uniforms(rows, weights.device) * cdf[:, -1]  # [R], in [0, total)
        picked = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0]  # first cdf > target
        # Zero-weight tokens never raise the cdf, so they are never first past the target; only
        # rounding at the very top can run off the end, where the likeliest token stands in.
        picked = picked.clamp_max_(weights.shape[1] - 1)
        valid = weights.gather(1, picked[:, None])[:, 0] > 0
        # Reading `valid` back would wait for a GPU's queued work; on the CPU it is free and
        # saves the fallback's argmax.
        if scores.device.type == "cpu" and bool(valid.all()):
            return picked
        return torch.where(valid, picked, _argmax(weights))

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
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape[1] > 0:
        ops = _cpu_bfloat16_ops()
        if ops is not None:
            return ops.argmax(x.contiguous())
    return x.max(dim=-1).indices


_cpu_ops: list[CpuFusedOps | None] = []  # empty until first asked for


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
    """exp(score - row max) after top-k, top-p and min-p filtering; 0 where filtered, 1 for the best token.

    Only rows that use top-k or top-p look at ranked candidates. There are as many as the largest
    top-k, or for top-p without top-k a first guess of TOP_P_CANDIDATES, widened to the whole
    vocabulary only when some row's guess holds less than its top_p of the mass (a full sort is rare).
    """
    ranked = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if not ranked:
        weights = _relative_exp(scores)
    elif len(ranked) == len(params):
        weights = _ranked_weights(scores, params)
    else:
        ranked_set = set(ranked)
        plain = [i for i in range(len(params)) if i not in ranked_set]
        weights = torch.empty_like(scores)
        weights[plain] = _relative_exp(scores[plain])
        weights[ranked] = _ranked_weights(scores[ranked], [params[i] for i in ranked])
    if any(p.min_p > 0 for p in params):
        # The best token weighs 1, so min_p is directly the weight threshold (relative, so
        # renormalisation after top-k/top-p does not matter).
        min_p = to_device([p.min_p for p in params], scores.device)
        weights = weights.masked_fill(weights < min_p[:, None], 0.0)
    return weights


def _relative_exp(scores: torch.Tensor) -> torch.Tensor:  # [R, V]
    return (scores - scores.amax(dim=-1, keepdim=True)).exp_()


def _ranked_weights(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [Rk, V]
    vocab = scores.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_ps = [p.top_p for p in params]
    width = min(vocab, max(k if k < vocab else TOP_P_CANDIDATES for k in ks))
    top_scores, top_ids = scores.topk(width, dim=-1)  # [Rk, K], sorted
    # A top-p-only row's top_p is a share of the whole vocabulary's mass, not the candidates'.
    full_lse = scores.logsumexp(dim=-1)  # [Rk]
    if width < max(ks):
        mass = (top_scores - full_lse[:, None]).exp().sum(dim=-1).tolist()
        if any(k == vocab and m < p for k, m, p in zip(ks, mass, top_ps, strict=True)):
            top_scores, top_ids = scores.topk(vocab, dim=-1)
        # Otherwise every token past the candidates lies beyond the top-p cut anyway.
    keep = _top_k_top_p_keep(top_scores, ks, top_ps, [k < vocab for k in ks], full_lse)  # [Rk, K]
    kept = (top_scores - top_scores[:, :1]).exp_().masked_fill_(~keep, 0.0)  # [Rk, K]
    return torch.zeros_like(scores).scatter_(1, top_ids, kept)


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
    """log_softmax of the raw logits: the chosen token's value and, when asked, the top n."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return out
    index = to_device(wanted, logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [W, V] float32
    chosen_lp = logprobs.gather(1, chosen.index_select(0, index)[:, None])[:, 0].tolist()
    top_n = max(params[i].logprobs or 0 for i in wanted)
    top_lp: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if top_n > 0:
        values, ids = logprobs.topk(min(top_n, logits.shape[1]), dim=-1)
        top_lp, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(wanted):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen_lp[j], top_ids[j][:n], top_lp[j][:n])
    return out

"""Token sampling for one step, vectorised over the batch.

Order of operations per row: repetition penalty (HF style, prompt + output tokens), presence and
frequency penalties (OpenAI style, output tokens only), then greedy argmax when temperature is 0,
else temperature, top-k, top-p, min-p and a draw. Logprobs always describe the raw model logits.

A draw is argmax(p / E) with E ~ Exp(1) per vocabulary entry ("exponential race"), which picks
token i with probability p_i. A seeded row takes its E from a generator seeded with
(seed, number of tokens already generated), over the whole vocabulary in token-id order, so
its token depends on nothing else in the batch and repeats exactly when the step is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


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
        """Pick one token per row of `logits` ([S, V] float32)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} do not match {len(rows)} rows"
        )
        assert logits.dtype == torch.float32, f"logits must be float32, got {logits.dtype}"
        if not rows:
            return SamplerOutput([], [])
        params = [r.params for r in rows]
        scores = apply_penalties(logits, rows)  # [S, V]
        chosen = scores.argmax(dim=-1)  # [S]; final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            picked = self._draw(scores.index_select(0, index), [rows[i] for i in random_rows])
            chosen = chosen.index_copy(0, index, picked)
        token_ids = chosen.tolist()
        return SamplerOutput(token_ids, compute_logprobs(logits, chosen, params))

    def _draw(self, scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:  # [R] int64
        temps = torch.tensor([r.params.temperature for r in rows], device=scores.device)
        probs = filtered_probs(scores / temps[:, None], [r.params for r in rows])  # [R, V], zero = filtered
        noise = self._exponential_noise(probs.shape, rows, probs.device)  # [R, V]
        return (probs / noise).argmax(dim=-1)

    def _exponential_noise(
        self, shape: torch.Size, rows: Sequence[SamplingRow], device: torch.device
    ) -> torch.Tensor:
        noise = torch.empty(shape, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            block = torch.empty((len(unseeded), shape[1]), device=device)
            block.exponential_(generator=self._generator(device))
            noise[unseeded] = block
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(row.params.seed, len(row.output_token_ids)))
                noise[i].exponential_(generator=gen)
        # exponential_ may return exactly 0; a tiny floor keeps p / E finite and filtered rows at 0.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

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
    """Repetition (prompt + output), presence and frequency (output) penalties; `logits` is untouched."""
    num_rows, vocab = logits.shape
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    additive = [
        i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not rep and not additive:
        return logits
    scores = logits.clone()
    device = logits.device
    if rep:
        history = [(i, rows[i].prompt_token_ids) for i in rep] + [(i, rows[i].output_token_ids) for i in rep]
        seen = _token_counts(history, num_rows, vocab, device) > 0  # [S, V]
        penalty = torch.ones(num_rows, 1, device=device)
        penalty[rep, 0] = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=device)
        penalized = torch.where(scores > 0, scores / penalty, scores * penalty)
        scores = torch.where(seen, penalized, scores)
    if additive:
        counts = _token_counts([(i, rows[i].output_token_ids) for i in additive], num_rows, vocab, device)
        presence = torch.zeros(num_rows, 1, device=device)
        frequency = torch.zeros(num_rows, 1, device=device)
        presence[additive, 0] = torch.tensor(
            [rows[i].params.presence_penalty for i in additive], device=device
        )
        frequency[additive, 0] = torch.tensor(
            [rows[i].params.frequency_penalty for i in additive], device=device
        )
        scores -= presence * (counts > 0) + frequency * counts
    return scores


def _token_counts(
    lists: Sequence[tuple[int, Sequence[int]]], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:  # [S, V] float32: how often each token occurs in the row's given lists
    arrays = [np.asarray(ids, dtype=np.int64) for _, ids in lists]
    row_of = np.repeat(np.array([row for row, _ in lists], dtype=np.int64), [a.size for a in arrays])
    flat = torch.from_numpy(row_of * vocab + np.concatenate([*arrays, np.empty(0, np.int64)])).to(device)
    return torch.bincount(flat, minlength=num_rows * vocab).view(num_rows, vocab).float()


def filtered_probs(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:  # [R, V]
    """Softmax after top-k, top-p and min-p filtering (filtered tokens get probability 0).

    Only rows that use top-k or top-p look at sorted candidates, and the candidate count is the
    largest k among them; a full sort happens only when a row asks for top-p without top-k.
    """
    vocab = scores.shape[1]
    probs = torch.softmax(scores, dim=-1)  # [R, V]
    ranked = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if ranked:
        ks = [min(params[i].top_k, vocab) if params[i].top_k > 0 else vocab for i in ranked]
        index = torch.tensor(ranked, device=scores.device)
        top_scores, top_ids = scores.index_select(0, index).topk(max(ks), dim=-1)  # [Rk, K], sorted
        keep = _top_k_top_p_keep(top_scores, ks, [params[i].top_p for i in ranked])  # [Rk, K]
        kept_scores = torch.full((len(ranked), vocab), float("-inf"), device=scores.device)
        kept_scores.scatter_(1, top_ids, top_scores.masked_fill(~keep, float("-inf")))
        probs[ranked] = torch.softmax(kept_scores, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=scores.device)
    if bool((min_p > 0).any()):
        # Relative to the most likely token, so renormalisation after top-k/top-p does not matter.
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p_keep(
    top_scores: torch.Tensor, ks: Sequence[int], top_ps: Sequence[float]
) -> torch.Tensor:  # [Rk, K] bool
    width = top_scores.shape[1]
    device = top_scores.device
    rank = torch.arange(width, device=device)[None, :]  # [1, K]
    keep = rank < torch.tensor(ks, device=device)[:, None]
    top_p = torch.tensor(top_ps, device=device)[:, None]  # [Rk, 1]
    if bool((top_p < 1.0).any()):
        # Renormalised over the top-k survivors, as when top-p follows top-k.
        probs = torch.softmax(top_scores.masked_fill(~keep, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # [Rk, K]: mass of strictly better tokens
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
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)  # [W, V]
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

"""bench/sampler.py: another revision's sampler beside this one, on the same logits."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import sampler as bench

from gpu_worker import sampler

# The last sampler that summed the whole vocabulary for every draw, in token-id order.
WHOLE_VOCABULARY = "6e5f0c3"
# The first sampler whose top-p rows took the C nucleus cut.
NUCLEUS_KERNEL = "a22a197"


@pytest.mark.parametrize(
    "setting",
    [{"temperature": 0.8, "top_k": 50}, {"temperature": 1.2, "top_k": 300, "top_p": 0.9, "min_p": 0.01}],
)
def test_ranked_rows_draw_what_the_whole_vocabularys_running_total_drew(
    setting: dict[str, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draws over a row's candidates alone add the same weights in the same order as the sum
    over the whole vocabulary did (the filtered ones were zeros): the same tokens, seed for seed.
    (Ranked draws are the GPU's, and the CPU's without the C kernels, as here.)"""
    monkeypatch.setattr(sampler, "_cpu_bfloat16_ops", lambda: None)
    before = bench.sampler_at(WHOLE_VOCABULARY, tmp_path, kernels=False)
    logits = bench.synthetic_logits(2, vocab=5000)
    tokens = bench.seeded_tokens(sampler, logits, setting)
    assert bench.seeded_tokens(before, logits, setting) == tokens
    assert len(set(tokens)) > 10  # draws, not one token over and over


def test_the_nucleus_is_counted_in_ranked_tokens() -> None:
    logits = bench.synthetic_logits(1, vocab=3000)
    sizes = bench.nucleus_sizes(logits, 1.0, 0.9)
    assert sizes.shape == (bench.ROWS,) and int(sizes.min()) >= 1
    # A nucleus widens with the temperature and with top_p.
    assert bool((bench.nucleus_sizes(logits, 1.5, 0.9) >= sizes).all())
    assert bool((bench.nucleus_sizes(logits, 1.0, 0.99) >= sizes).all())


def test_the_revisions_sampler_calls_its_own_kernels(tmp_path: Path) -> None:
    """From a22a197 on, the sampler's top-p rows take a C kernel's nucleus: the revision's build of
    it, through the revision's CpuFusedOps, serves the revision's sampler; this checkout's draw
    kernel finds the same nuclei (the same cut: seeded draws agree)."""
    before = bench.sampler_at(NUCLEUS_KERNEL, tmp_path)
    theirs, ours = before._cpu_ops[0], sampler._cpu_bfloat16_ops()
    assert theirs is not None and ours is not None
    assert hasattr(theirs, "nucleus") and not hasattr(ours, "nucleus")
    address = [ctypes.cast(ops._lib.duoserve_argmax_rows, ctypes.c_void_p).value for ops in (theirs, ours)]
    assert address[0] != address[1]  # another library's
    logits = bench.synthetic_logits(2, vocab=5000)
    for setting in ({"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.2, "top_p": 0.99}):
        tokens = bench.seeded_tokens(sampler, logits, setting)
        assert bench.seeded_tokens(before, logits, setting) == tokens
        assert len(set(tokens)) > 10

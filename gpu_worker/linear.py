"""Matrix multiplies of the model's linear layers: y = x @ weight.T (+ bias).

On the CPU in bfloat16, weights are reordered once into oneDNN's blocked layout and multiplied
with its packed-weight kernel: measured here 1.3-1.5x faster than `F.linear` for a whole
decode step (weights stream from memory every step, and `F.linear` re-reads them in their
plain layout) and for long prefill chunks. Steps of one or two rows (single-stream decode)
take the small-batch C kernel instead where it builds (kernels/cpu_linear.py): it streams the
weights about 1.3x faster than oneDNN at one row. Elsewhere `F.linear` is used as is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.cpu_linear import MAX_ROWS, KernelBuildError, SmallBatchLinear, load_small_batch_linear

log = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]

# oneDNN picks its blocking for this many rows; decode steps batch about this many sequences.
PACKING_BATCH_HINT = 64


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN's packed bfloat16 linear can run here."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


_small_batch: list[SmallBatchLinear | None] = []  # [] until tried once
_small_batch_lock = threading.Lock()


def small_batch_kernel() -> SmallBatchLinear | None:
    """The small-batch linear kernel, or None where it cannot be built (said once in the log)."""
    with _small_batch_lock:
        if not _small_batch:
            try:
                _small_batch.append(load_small_batch_linear())
            except KernelBuildError as exc:
                log.info("small-batch linear kernel unavailable, oneDNN takes every batch size: %s", exc)
                _small_batch.append(None)
        return _small_batch[0]


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, small_batch: SmallBatchLinear | None = None
) -> LinearFn:
    """A function computing x @ weight.T (+ bias) for x [T, in] → [T, out].

    `packed`: oneDNN's packed bfloat16 kernel; with `small_batch` too, steps of at most
    MAX_ROWS rows take that kernel instead.
    """
    if not packed:
        return lambda x: F.linear(x, weight, bias)
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    small = small_batch if small_batch is not None and small_batch.supports(weight) else None
    plain_bias = None if bias is None else bias.contiguous()

    def packed_linear(x: torch.Tensor) -> torch.Tensor:
        if small is not None and 1 <= x.shape[0] <= MAX_ROWS and x.stride(-1) == 1:
            return small(x, weight, plain_bias)
        return linear_pointwise(x, packed_weight, bias, "none", [], "")

    return packed_linear

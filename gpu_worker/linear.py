"""Matrix multiplies of the model's linear layers: y = x @ weight.T (+ bias).

On the CPU in bfloat16, weights are reordered once into oneDNN's blocked layout and multiplied
with its packed-weight kernel: measured here 1.3-1.5x faster than `F.linear` for a whole
decode step (weights stream from memory every step, and `F.linear` re-reads them in their
plain layout) and for long prefill chunks. Decode-sized steps take duoserve's own kernels where
they build: AMX tiles for 1 to 64 rows (kernels/cpu_amx.py: 10-30% faster than oneDNN there),
else, for one or two rows, the AVX-512 BF16 small-batch kernel (kernels/cpu_linear.py: it
streams the weights about 1.3x faster than oneDNN at one row). Elsewhere `F.linear` is used as is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_amx
from kernels.cpu_amx import AmxLinear, load_amx_linear
from kernels.cpu_linear import MAX_ROWS, KernelBuildError, SmallBatchLinear, load_small_batch_linear

log = logging.getLogger(__name__)

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


_kernels: dict[str, SmallBatchLinear | AmxLinear | None] = {}  # a name is absent until tried once
_kernels_lock = threading.Lock()


def small_batch_kernel() -> SmallBatchLinear | None:
    """The small-batch linear kernel, or None where it cannot be built (said once in the log)."""
    kernel = _kernel("small-batch", load_small_batch_linear)
    assert kernel is None or isinstance(kernel, SmallBatchLinear)
    return kernel


def amx_kernel() -> AmxLinear | None:
    """The AMX linear kernel, or None where it cannot run (said once in the log)."""
    kernel = _kernel("AMX", load_amx_linear)
    assert kernel is None or isinstance(kernel, AmxLinear)
    return kernel


def _kernel(
    name: str, loader: Callable[[], SmallBatchLinear | AmxLinear]
) -> SmallBatchLinear | AmxLinear | None:
    with _kernels_lock:
        if name not in _kernels:
            try:
                _kernels[name] = loader()
            except KernelBuildError as exc:
                log.info("%s linear kernel unavailable, oneDNN takes its batch sizes: %s", name, exc)
                _kernels[name] = None
        return _kernels[name]


class Linear:
    """x [T, in] → x @ weight.T (+ bias) [T, out], by the fastest kernel here for T rows.

    Not `packed`: `F.linear`. `packed`: oneDNN's packed bfloat16 kernel, except that with `amx`
    steps of up to cpu_amx.MAX_ROWS rows take the AMX kernel (on `amx_weight`, packed for it), and
    without it but with `small_batch`, steps of up to MAX_ROWS rows take the small-batch kernel.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: bool,
        small_batch: SmallBatchLinear | None = None,
        amx: AmxLinear | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self._onednn_weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT) if packed else None
        )
        self._plain_bias = None if bias is None else bias.contiguous()
        self._amx = amx if packed and amx is not None and amx.supports(weight) else None
        self.amx_weight = cpu_amx.pack(weight) if self._amx is not None else None
        usable = packed and self._amx is None and small_batch is not None and small_batch.supports(weight)
        self._small = small_batch if usable else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        if self._amx is not None and self.amx_weight is not None:
            if 1 <= rows <= cpu_amx.MAX_ROWS and x.stride(-1) == 1:
                return self._amx(x, self.amx_weight, self._plain_bias)
        elif self._small is not None and 1 <= rows <= MAX_ROWS and x.stride(-1) == 1:
            return self._small(x, self.weight, self._plain_bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._onednn_weight, self.bias, "none", [], "")

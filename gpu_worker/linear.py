"""Matrix multiplies of the model's linear layers: y = x @ weight.T (+ bias).

On the CPU in bfloat16, weights are reordered once into oneDNN's blocked layout and multiplied
with its packed-weight kernel: measured here 1.3-1.5x faster than `F.linear` for a whole
decode step (weights stream from memory every step, and `F.linear` re-reads them in their
plain layout) and for long prefill chunks. Decode-sized steps, 1 to 64 rows, take duoserve's
pair-layout kernel where it builds (kernels/cpu_pair_linear.py: AMX tiles or AVX-512 BF16 dot
products, 10-45% faster than oneDNN there). In float32 the same oneDNN packing serves every
step: on an AVX2-only 2-core AMD EPYC (Zen 3) it multiplied 1.5-4.3x faster than `F.linear`
(MKL) at SmolLM2's shapes, e.g. 8 rows through the MLP's gate/up 0.49 against 2.1 ms, the
49152-row LM head for one row 10.6 against 18.0 ms. Elsewhere `F.linear` is used as is.

Linears keep their weights as the model's files store them (a GGUF file's blocks, 16-bit floats)
where `blocks_take` says so (float32 on the CPU, and bfloat16 on CPUs that cannot multiply
bfloat16), and multiply on them: see kernels/cpu_block_linear.py. On CPUs that multiply bfloat16
with AVX-512 BF16, bfloat16 linears keep the blocks beside their bfloat16 weights for steps of
up to SMALL_STEP_ROWS rows (`small_steps_take_blocks`). In bfloat16 there, a weight
without quantized blocks multiplies on itself. A weight the worker never read from the files (a
shape on the "meta" device) multiplies on its blocks at every step: a float32 server then holds
the blocks alone, not float32 and oneDNN-packed copies beside them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import cpu_block_linear, cpu_pair_linear
from kernels._launch import dtype_name
from kernels.block_weights import BF16, Blocks, BlockWeight
from kernels.cpu_block_linear import BlockLinear, load_block_linear
from kernels.cpu_build import BF16_DOT, cpu_has
from kernels.cpu_pair_linear import KernelBuildError, PairLinear, load_pair_linear
from kernels.cpu_stack import BLOCK_STACK_MAX_ROWS

log = logging.getLogger(__name__)

# oneDNN picks its blocking for this many rows; decode steps batch about this many sequences.
PACKING_BATCH_HINT = 64

# float32 steps of up to this many rows take the block kernel where a linear has GGUF blocks; past
# it oneDNN's packed kernel on the float32 copy multiplies as fast or faster. The block kernel's
# tiles are 8 floats wide (AVX2), so where oneDNN has AVX-512 it wins from far fewer rows. SmolLM2's
# linears and head (bench/linear_ab.py), blocks against oneDNN:
# - a 2-core AMD EPYC (Zen 3, AVX2): 162 ms against 211 at 64 rows, 639 against 668 at 256, 1275
#   against 1170 at 512 (at c8d5bf9);
# - a 2-core AMD EPYC (Zen 4, AVX-512): 30.9 against 34.0 at 16 rows, 92.6 against 92.9 at 64,
#   369 against 347 at 256;
# - a 2-core Intel Xeon (AVX-512, AMX): 51.2-53.0 against 54.2-55.2 at 32 rows, 75.3 against 71.5
#   at 48, 93-95 against 84-88 at 64, 185.9 against 130.4 at 128, 389.5 against 242.9 at 256.
#   Served in float32 there, a 256-token prompt's prefill step took 224-242 ms against 335-367
#   with the blocks up to 256 rows.
# With AVX-512 the limit is the decode stack's 64 rows (BLOCK_STACK_MAX_ROWS), not less: decode
# steps up to it run in the stack, on the blocks, and op by op they then get the same bits.
BLOCK_MAX_ROWS = BLOCK_STACK_MAX_ROWS if cpu_has("avx512f") else cpu_block_linear.MAX_ROWS


def cpu_multiplies_bfloat16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX)."""
    return cpu_has("avx512_bf16") or cpu_has("amx_bf16")


# bfloat16 steps of up to this many rows take the block kernel's bfloat16 dot products where
# `small_steps_take_blocks`: on a 2-core AMD EPYC (Zen 4), SmolLM2's linears and head at one row
# 7.0 ms on the Q4_1/Q8_0 blocks against 9.0 on the pair-layout kernel's bfloat16 copy, at two 7.8
# against 9.0, at four 10.1 against 9.1 (bench/linear_ab.py --dtype bfloat16). A step of one or
# two rows reads 96 MB of blocks instead of 269 MB of bfloat16 weights. On a 2-core Zen 5 the
# 256-bit dot products lost (5.6 against 5.1 at one row, 5.8 against 5.4 at two); since the blocks'
# 512-bit path (kernels/cpu/block_linear.c, dot_pass_512) they win there, 5.6-5.7 against 7.7-8.5 at
# one or two rows and 5.1-6.8 against 7.6-9.3 at three to six in one run. On Zen 4, where 512-bit
# operations take two passes, that path won at up to four rows and lost past them: 7.3-8.0 against
# 8.9-9.6 at one to three, 8.6-9.1 against 9.2-9.7 at four, 9.4-10.4 against 9.2-9.7 at five and
# six (three runs); a whole decode step of three sequences 1.17x faster on the blocks, of four 1.08x,
# of five and six 0.80-0.83x (bench/results/issue4-zen4-session44.md). Four serves both.
SMALL_STEP_ROWS = 4


def small_steps_take_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """True where bfloat16 linears with quantized blocks keep them beside their bfloat16 weights
    and steps of up to SMALL_STEP_ROWS rows take the block kernel's dot products (AVX-512 BF16,
    no AMX: on a 2-core AMX Xeon the dot products took 10.3-10.6 ms at one row against the AMX
    pair kernel's 10.5-10.8, and 12.0-12.7 at two against 10.6-10.8, bench/linear_ab.py
    --dtype bfloat16, so there the blocks would not pay for their memory). Linears hold the blocks
    only where the loaded kernel has the dot products (BlockLinear.dot_products)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and cpu_has("avx512_bf16")
        and not cpu_has("amx_bf16")
    )


def wants_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the worker loads the files' blocks for its linears (with --block-linear)."""
    return blocks_take(dtype, device) or small_steps_take_blocks(dtype, device)


def pair_takes_every_step(pair: PairLinear) -> bool:
    """True where the pair-layout kernel takes steps of every size, not only decode-sized ones: on
    its AVX-512 BF16 dot products. On a 2-core AMD EPYC (Zen 5) SmolLM2's four linears of 30 layers
    took 33.8 ms on it at 128 rows against oneDNN's 42.9, 59.4 against 64.9 at 256 and 440.4 against
    481.0 at 2048 (987 GFLOP/s, this CPU's dot-product peak; a scratch loop of them alone made
    931-968); its gate_up with the SiLU in its epilogue beats oneDNN's SiLU and multiply as post-ops
    too. On Zen 4 it tied oneDNN at prefill sizes (bench/results/issue4-zen4-session33.md). On AMX
    tiles oneDNN, itself on AMX, is as fast or faster past 64 rows, and takes them."""
    return pair.engine == BF16_DOT


def blocks_take(dtype: torch.dtype, device: torch.device) -> bool:
    """True when linears with blocks multiply on them in `dtype` on `device`: float32 on the
    CPU, and bfloat16 on a CPU that cannot multiply bfloat16. There torch's bfloat16 matmul is
    emulated: on an AVX2-only AMD EPYC (Zen 3) it took 4-5x the block kernel's time for SmolLM2's
    linears at 64-1024 rows, so in bfloat16 the blocks take steps of every size."""
    if device.type != "cpu":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and not cpu_multiplies_bfloat16())


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN's packed linear can run here in `dtype` (float32 or bfloat16): torch has it,
    and this CPU has the instructions it needs (for bfloat16, AVX-512 BF16 or AVX-NE-CONVERT);
    probed once per dtype."""
    if not (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return _probed_once(_packed, dtype, _probe_packed)


def _probed_once(
    results: dict[torch.dtype, bool], dtype: torch.dtype, probe: Callable[[torch.dtype], bool]
) -> bool:
    """`probe(dtype)`, run the first time only; `results` keeps its answer."""
    with _probe_lock:
        if dtype not in results:
            results[dtype] = probe(dtype)
        return results[dtype]


def _probe_packed(dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    # Exact values in `dtype`, entries of x @ w.T of about unit size.
    x, w = (torch.randn(rows, 64, generator=generator).to(dtype) / d for rows, d in ((8, 1), (32, 8)))
    try:
        got = _onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT))
    except RuntimeError as exc:
        log.info("oneDNN packed %s linear unavailable, linears take F.linear: %s", dtype, exc)
        return False
    close = torch.allclose(got.float(), x.float() @ w.float().T, atol=1e-2, rtol=1e-2)
    if not close:
        log.info("oneDNN packed %s linear disagrees with float32 matmul, linears take F.linear", dtype)
    return close


_pair: list[PairLinear | None] = []  # empty until tried once
_block: dict[torch.dtype, BlockLinear | None] = {}  # by x's dtype, once tried
_packed: dict[torch.dtype, bool] = {}  # by dtype, once probed
# A lock each, so that one kernel's build does not hold up another's: the worker builds the pair
# linear (and the decode stack on it) while the block linear's longer build runs.
_probe_lock, _pair_lock, _block_lock = threading.Lock(), threading.Lock(), threading.Lock()


def pair_kernel() -> PairLinear | None:
    """The pair-layout linear kernel, or None where it cannot run (said once in the log, with
    the engine it runs on where it does)."""
    with _pair_lock:
        if not _pair:
            try:
                loaded = load_pair_linear()
                log.info(
                    "pair-layout linear kernel multiplies on %s, steps of %s",
                    loaded.engine,
                    "every size"
                    if pair_takes_every_step(loaded)
                    else f"up to {cpu_pair_linear.MAX_ROWS} rows",
                )
                _pair.append(loaded)
            except KernelBuildError as exc:
                log.info("pair-layout linear kernel unavailable, oneDNN takes every batch: %s", exc)
                _pair.append(None)
        return _pair[0]


def block_kernel(dtype: torch.dtype = torch.float32) -> BlockLinear | None:
    """The block linear kernel for x in `dtype` (float32 or bfloat16; each has a library of its
    own), or None where it cannot run (said once in the log)."""
    with _block_lock:
        if dtype not in _block:
            try:
                _block[dtype] = load_block_linear(dtype)
                log.info(
                    "block linear kernel loaded for %s: float32 steps of up to %d rows take it, "
                    "bfloat16 steps all (%d where the CPU multiplies bfloat16), and every step of a "
                    "linear without a dense copy (--dense-weights)",
                    dtype_name(dtype),
                    BLOCK_MAX_ROWS,
                    SMALL_STEP_ROWS,
                )
            except KernelBuildError as exc:
                log.info("block linear kernel unavailable, float32 copies take every step: %s", exc)
                _block[dtype] = None
        return _block[dtype]


class Linear:
    """x [T, in] → x @ weight.T (+ bias) [T, out], by the fastest kernel here for T rows.

    Not `packed`: `F.linear`. `packed`: oneDNN's packed kernel, except that with `pair` steps of
    up to cpu_pair_linear.MAX_ROWS rows take the pair-layout kernel (on `pair_weight`), and steps of
    every size where it multiplies on dot products (`pair_takes_every_step`). With
    `blocks` (the weight as its file stores it; float32, or bfloat16 where `blocks_take` or
    `small_steps_take_blocks`), steps take the block kernel where it loads: in float32 those of up
    to BLOCK_MAX_ROWS rows, in bfloat16 all of them, or those of up to SMALL_STEP_ROWS where the
    CPU multiplies bfloat16 (`block_max_rows`). With `self_blocks`, where `blocks_take` bfloat16,
    a bfloat16 weight without quantized blocks is its own blocks (the same values, no copy). A
    `weight` on the "meta" device (a shape, not read) needs `blocks`, which then take every step
    (`blocks_only`).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: bool,
        pair: PairLinear | None = None,
        blocks: Blocks | None = None,
        self_blocks: bool = False,
    ) -> None:
        # A weight on the "meta" device is a shape only (never read from the files): the blocks
        # take every step.
        self.blocks_only = weight.is_meta
        device = torch.device("cpu") if self.blocks_only else weight.device
        packed = packed and not self.blocks_only
        self.weight = weight
        self.bias = bias
        self.packed = packed
        self._plain_bias = None if bias is None else bias.contiguous()
        self._pair = pair if packed and pair is not None and pair.supports(weight) else None
        self.pair_weight = cpu_pair_linear.pack(weight) if self._pair is not None else None
        # Where the pairs take every step oneDNN takes none, and needs no packed copy.
        self.pair_every_step = self._pair is not None and pair_takes_every_step(self._pair)
        self._onednn_weight = self._pack_for_onednn() if packed and not self.pair_every_step else None
        self.blocks: Blocks | None = None
        self._block: BlockLinear | None = None
        own_blocks = False
        # A weight that is its own blocks reads as many bytes as its pair layout: only where the
        # blocks take every step (`blocks_take`), not the small steps of a CPU that multiplies
        # bfloat16, which gain from the fewer bytes of quantized blocks.
        if (
            self_blocks
            and not self.blocks_only
            and weight.dtype == torch.bfloat16
            and blocks_take(weight.dtype, device)
            and (blocks is None or (isinstance(blocks, BlockWeight) and blocks.type == BF16))
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_contiguous()
        ):
            blocks = BlockWeight.dense(weight.detach())
            own_blocks = True
        # Steps of up to this many rows take the blocks (None: every step).
        self.block_max_rows: int | None = BLOCK_MAX_ROWS if weight.dtype == torch.float32 else None
        small_steps = small_steps_take_blocks(weight.dtype, device)
        if blocks is not None and (blocks_take(weight.dtype, device) or small_steps):
            if (blocks.n, blocks.k) != tuple(weight.shape):
                raise ValueError(
                    f"blocks of a [{blocks.n}, {blocks.k}] weight for a {list(weight.shape)} one"
                )
            self._block = block_kernel(weight.dtype)
            if small_steps and not self.blocks_only:  # beside the pair-layout and oneDNN kernels
                self.block_max_rows = SMALL_STEP_ROWS
                if self._block is not None and not self._block.dot_products:
                    self._block = None  # rounding each weight, the blocks are slower than the pairs
            self.blocks = blocks if self._block is not None else None
        self._weight_is_blocks = own_blocks and self.blocks is not None  # the block kernel reads it
        if self.blocks_only and self.blocks is None:
            raise ValueError(
                f"a {list(weight.shape)} weight held as a shape only needs blocks and the block kernel"
            )

    def _pack_for_onednn(self) -> torch.Tensor | None:
        return torch.ops.mkldnn._reorder_linear_weight(self.weight, PACKING_BATCH_HINT)

    @property
    def reads_weight(self) -> bool:
        """Whether a step can read `weight` itself: an unpacked linear multiplies on it, and the
        block kernel on a bfloat16 weight that is its own blocks. A packed linear's steps read only
        the copies packed from it (oneDNN's, the pair layout) and its blocks, so once packed its
        weight may be held as a shape alone (`LlamaModel.release_unread_weights`)."""
        return not self.weight.is_meta and (not self.packed or self._weight_is_blocks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks_only:
            x = _side_by_side(x)
        if self.takes_block_kernel(x):
            assert self._block is not None and self.blocks is not None
            return self._block(x, self.blocks, self._plain_bias)
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        return self._own_kernel(x) if self.takes_own_kernel(x) else self._onednn(x)

    def takes_block_kernel(self, x: torch.Tensor) -> bool:
        """True when a step of x's rows runs on the block kernel."""
        rows = x.shape[0]
        if self.blocks_only:
            return True
        return (
            self.blocks is not None
            and x.stride(-1) == 1
            and rows >= 1
            and (self.block_max_rows is None or rows <= self.block_max_rows)
        )

    @property
    def pair_engine(self) -> str | None:
        """What the pair-layout kernel of this linear multiplies on, or None when it has none."""
        return None if self._pair is None else self._pair.engine

    def takes_own_kernel(self, x: torch.Tensor) -> bool:
        """True when a step of x's rows runs on duoserve's pair-layout kernel, not oneDNN: up to
        cpu_pair_linear.MAX_ROWS rows on AMX tiles, every step on the dot products
        (`pair_takes_every_step`)."""
        if self._pair is None:
            return False
        if self.pair_every_step:
            return True
        return x.stride(-1) == 1 and 1 <= x.shape[0] <= cpu_pair_linear.MAX_ROWS

    def _own_kernel(self, x: torch.Tensor) -> torch.Tensor:
        assert self._pair is not None and self.pair_weight is not None
        return self._pair(_side_by_side(x), self.pair_weight, self._plain_bias)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self._onednn_weight, self.bias)


class GateUpLinear(Linear):
    """The MLP's gate and up projections as one linear: weight [2F, in] is gate's rows, then up's.

    `silu_and_mul` gives SiLU(x @ gate.T) * (x @ up.T). Steps that oneDNN takes (prefill-sized)
    run it as two oneDNN multiplies with the SiLU and the product fused in as post-ops, so the
    [T, 2F] projection is never written out and read back. Measured at SmolLM2's shapes: one
    layer's 2048 rows 4.4 against 5.8 ms; a whole 2048-token prefill step 462 against 519 ms (see
    bench/cpu_step.py's prefill table). For that, oneDNN packs gate and up separately, in place of
    the packing of the whole weight; other steps keep `fallback`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        packed: bool,
        pair: PairLinear | None = None,
        blocks: Blocks | None = None,
        self_blocks: bool = False,
    ) -> None:
        super().__init__(weight, None, packed, pair, blocks, self_blocks)
        # Switched off per instance to compare with the fused op (bench/cpu_step.py).
        onednn = self.packed and not self.pair_every_step
        self.post_ops = onednn and onednn_post_ops_available(weight.dtype)
        half = weight.shape[0] // 2
        self._gate: torch.Tensor | None = None
        self._up: torch.Tensor | None = None
        if onednn:
            self._gate = torch.ops.mkldnn._reorder_linear_weight(
                weight[:half].contiguous(), PACKING_BATCH_HINT
            )
            self._up = torch.ops.mkldnn._reorder_linear_weight(weight[half:].contiguous(), PACKING_BATCH_HINT)

    def _pack_for_onednn(self) -> torch.Tensor | None:
        return None  # gate and up are packed apart instead

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([_onednn_linear(x, self._gate), _onednn_linear(x, self._up)], dim=1)

    def silu_and_mul(
        self, x: torch.Tensor, fallback: Callable[[torch.Tensor], torch.Tensor], c_rounding: bool = False
    ) -> torch.Tensor:  # [T, in] → [T, F]
        """SiLU(gate) * up; `fallback` maps the [T, 2F] projection to it where oneDNN does not run.
        With `c_rounding` (`fallback` is kernels/cpu/fused_ops.c's SiLU-and-multiply), a step that
        the pair kernel's dot products take runs the SiLU and the product in its epilogue instead:
        the same bits, without writing the projection."""
        if self.takes_block_kernel(x):
            return fallback(self(x))
        if self.takes_own_kernel(x):
            assert self._pair is not None and self.pair_weight is not None
            if c_rounding and self._pair.fuses_silu:
                return self._pair.silu_and_mul(_side_by_side(x), self.pair_weight)
            return fallback(self(x))
        if not self.post_ops:
            return fallback(self(x))
        gate = torch.ops.mkldnn._linear_pointwise(x, self._gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self._up, None, "mul")


def _side_by_side(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it where each row's elements do not lie side by side, as the C kernels read them."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _onednn_linear(
    x: torch.Tensor, packed_weight: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_post_ops: dict[torch.dtype, bool] = {}  # by dtype, once probed


def onednn_post_ops_available(dtype: torch.dtype) -> bool:
    """True when oneDNN's packed linear takes the SiLU and multiply post-ops here in `dtype` and they
    compute SiLU(x @ g.T) * (x @ u.T) (probed once per dtype on a small case against float32)."""
    return _probed_once(_post_ops, dtype, _probe_post_ops)


def _probe_post_ops(dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    # Entries of x @ g.T and x @ u.T of about unit size, so a wrong result cannot pass as noise.
    x, g, u = (torch.randn(80, 64, generator=generator).to(dtype) / d for d in (1, 8, 8))
    want = F.silu(x.float() @ g.float().T) * (x.float() @ u.float().T)
    try:
        gate = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(g, 80), None, "swish", [], ""
        )
        got = torch.ops.mkldnn._linear_pointwise.binary(
            x, gate, torch.ops.mkldnn._reorder_linear_weight(u, 80), None, "mul"
        )
    except RuntimeError as exc:
        log.info(
            "oneDNN %s SiLU/multiply post-ops unavailable, prefill MLPs take the fused op: %s", dtype, exc
        )
        return False
    close = torch.allclose(got.float(), want, atol=0.03, rtol=0.03)
    if not close:
        log.info(
            "oneDNN %s SiLU/multiply post-ops disagree with float32, prefill MLPs take the fused op", dtype
        )
    return close

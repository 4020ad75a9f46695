"""A decode step through every decoder layer in one C call (CPU: bfloat16 on pair-layout weights,
or float32 or bfloat16 on the block linear's blocks).

A decode step of a few sequences reads each weight once per token. When this stack was written,
streaming SmolLM2-135M's weights took about 13 ms a token on the machine of the time, yet the
per-op fused forward took ~24 ms: the rest was the cost of calling ~8 ops per layer from Python
(~30 us each: checks, tensor allocation, the call). `kernels/cpu/decode_stack.c`
calls the same C kernels in the same order on scratch buffers, so the results are the per-op
path's, bit for bit, and the step pays one call (more only when the worker has urgent steps to
run between layers). Two builds:
- bfloat16, for batches of up to cpu_pair_linear.MAX_ROWS rows, its linear the pair-layout one
  built for the per-op path's engine (AMX tiles or AVX-512 BF16 dot products);
- on blocks (`blocks=True`), for up to BLOCK_STACK_MAX_ROWS rows, its linear the block
  kernel on the weights as the files store them (its block types: kernels/cpu_block_linear.py; AVX2): in float32, or
  in bfloat16 for CPUs that cannot multiply bfloat16 (the linear widens its input and rounds its
  output; weights without quantized blocks are their own BF16 blocks). On a 2-core AMD
  EPYC (Zen 3) a one-sequence float32 SmolLM2 decode step took ~31 ms op by op, ~18 of them in
  the linears.

Bind a model's layers once (`bind`: weight and cache pointers, checked then), then `run` per
step. Needs what its linear needs; elsewhere `load_cpu_decode_stack` raises `KernelBuildError`
and the model keeps its per-op forward.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_pair_linear
from kernels._launch import dtype_name, require, require_contiguous
from kernels.block_weights import BlockRows, Blocks
from kernels.cpu_block_linear import block_linear_entry
from kernels.cpu_build import KernelBuildError, build, cpu_has, load, load_engine
from kernels.cpu_decode import MAX_BLOCK_SIZE, MAX_GROUP, MAX_HEAD_DIM, VECTOR_BITS
from kernels.kv_int8 import Int8Cache, cache_rows

# The block builds' decode steps: up to this many sequences (its scratch is sized for them);
# larger ones run op by op, each linear still on the blocks up to gpu_worker.linear.BLOCK_MAX_ROWS.
BLOCK_STACK_MAX_ROWS = 64

_lock = threading.Lock()
_loaded: dict[tuple[int, int, int, bool, bool, int, torch.dtype, bool], CpuDecodeStack] = {}


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("next_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("qkv_type", ctypes.c_int32),
        ("o_type", ctypes.c_int32),
        ("gate_up_type", ctypes.c_int32),
        ("down_type", ctypes.c_int32),
        ("k_part", ctypes.c_void_p),
        ("v_part", ctypes.c_void_p),
        ("up_part", ctypes.c_void_p),
        ("k_type", ctypes.c_int32),
        ("v_type", ctypes.c_int32),
        ("up_type", ctypes.c_int32),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
    ]


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One decoder layer's tensors, as the per-op forward uses them: the plain weights give the
    shapes, `pair_weights` (pair-layout stack) or `block_weights` (block stack) are what the stack
    multiplies by."""

    qkv_weight: torch.Tensor  # [q_size + 2 kv_size, hidden]
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [2 ffn, hidden]
    down_weight: torch.Tensor  # [hidden, ffn]
    next_norm: torch.Tensor  # [hidden]: the next layer's input norm, or the final norm
    k_cache: torch.Tensor | Int8Cache  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor | Int8Cache
    # The qkv, o, gate_up and down weights packed by kernels.cpu_pair_linear.pack.
    pair_weights: tuple[torch.Tensor, ...] = ()
    # Or the same four as GGUF blocks: qkv's as q's, k's and v's and gate_up's as gate's and up's
    # where their types differ (BlockRows).
    block_weights: tuple[Blocks, ...] = ()


class BoundStack:
    """A model's layers and KV cache bound to the kernel; `run` one decode step through them."""

    def __init__(self, stack: CpuDecodeStack, layers: Sequence[StackLayer], eps: float) -> None:
        self.stack = stack
        self.eps = eps
        self._tensors = list(layers)  # the pointers below stay valid while these live
        first = layers[0]
        self.hidden = first.qkv_weight.shape[1]
        self.num_kv_heads = first.k_cache.shape[2]
        self.kv_size = self.num_kv_heads * stack.head_dim
        self.q_size = self.kv_size * stack.group
        self.ffn = first.down_weight.shape[1]
        self.num_slots = first.k_cache.shape[0] * first.k_cache.shape[1]
        self.max_rows = stack.max_rows
        self.dtype = stack.dtype
        for index, layer in enumerate(layers):
            self._check(index, layer)
        self._layers = (_Layer * len(layers))(*(self._layer(layer) for layer in layers))
        self._scratch = threading.local()

    def _layer(self, layer: StackLayer) -> _Layer:
        # Parts past a fused linear's first (k, v; up) where its blocks differ in type.
        extra: list[int | None] = [None, None, None]
        extra_types = [0, 0, 0]
        if self.stack.blocks:
            firsts = [w.parts[0] if isinstance(w, BlockRows) else w for w in layer.block_weights]
            pointers = [w.blocks.data_ptr() for w in firsts]
            types = [w.type for w in firsts]
            qkv, _, gate_up, _ = layer.block_weights
            if isinstance(qkv, BlockRows):
                extra[0], extra[1] = (part.blocks.data_ptr() for part in qkv.parts[1:])
                extra_types[0], extra_types[1] = (part.type for part in qkv.parts[1:])
            if isinstance(gate_up, BlockRows):
                extra[2], extra_types[2] = gate_up.parts[1].blocks.data_ptr(), gate_up.parts[1].type
        else:
            pointers, types = [w.data_ptr() for w in layer.pair_weights], [0, 0, 0, 0]
        return _Layer(
            pointers[0],
            None if layer.qkv_bias is None else layer.qkv_bias.data_ptr(),
            pointers[1],
            layer.post_norm.data_ptr(),
            pointers[2],
            pointers[3],
            layer.next_norm.data_ptr(),
            *(cache_rows(cache).data_ptr() for cache in (layer.k_cache, layer.v_cache)),
            *types,
            *extra,
            *extra_types,
            *(
                cache.scales.data_ptr() if isinstance(cache, Int8Cache) else None
                for cache in (layer.k_cache, layer.v_cache)
            ),
        )

    def _check(self, index: int, layer: StackLayer) -> None:
        hidden, q_size, kv_size, ffn = self.hidden, self.q_size, self.kv_size, self.ffn
        expected = {
            "qkv_weight": (q_size + 2 * kv_size, hidden),
            "qkv_bias": (q_size + 2 * kv_size,),
            "o_weight": (hidden, q_size),
            "post_norm": (hidden,),
            "gate_up_weight": (2 * ffn, hidden),
            "down_weight": (hidden, ffn),
            "next_norm": (hidden,),
        }
        for name, shape in expected.items():
            tensor = getattr(layer, name)
            if tensor is None:
                continue
            # The stacks read only the shapes of the plain weights (the blocks or pair layouts are
            # what they multiply on): they may be shapes alone.
            shape_only = name.endswith("_weight") and tensor.is_meta
            require(
                tuple(tensor.shape) == shape
                and tensor.dtype == self.dtype
                and tensor.is_contiguous()
                and (tensor.device.type == "cpu" or shape_only),
                f"layers[{index}].{name}",
                tensor,
                f"a contiguous {dtype_name(self.dtype)} CPU tensor of shape {shape}",
            )
        if not self.stack.blocks:
            require(
                hidden % 32 == 0 and q_size % 32 == 0 and ffn % 32 == 0 and kv_size % 16 == 0,
                f"layers[{index}].qkv_weight",
                layer.qkv_weight,
                "hidden, q_size and ffn multiples of 32, kv_size of 16 (the pair-layout linear's tiling)",
            )
        field = "block_weights" if self.stack.blocks else "pair_weights"
        weights = getattr(layer, field)
        require(len(weights) == 4, f"layers[{index}].{field}", layer.qkv_weight, "four weights")
        for name, weight in zip(
            ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"), weights, strict=True
        ):
            out, k = expected[name]
            if self.stack.blocks:
                # Parts: q, k and v; gate and up. o and down are one weight each.
                parts = {"qkv_weight": (q_size, kv_size, kv_size), "gate_up_weight": (ffn, ffn)}.get(name)
                rows = tuple(p.n for p in weight.parts) if isinstance(weight, BlockRows) else None
                require(
                    (weight.n, weight.k) == (out, k) and (rows is None or rows == parts),
                    f"layers[{index}].{field} ({name})",
                    weight.parts[0].blocks if isinstance(weight, BlockRows) else weight.blocks,
                    f"the blocks of a [{out}, {k}] weight"
                    + (f", or its parts of {parts} rows" if parts else ", in one part"),
                )
                continue
            shape = (out // 16, k // 32, 16, 16, 2)
            require(
                tuple(weight.shape) == shape and weight.dtype == torch.bfloat16 and weight.is_contiguous(),
                f"layers[{index}].{field} ({name})",
                weight,
                f"a contiguous bfloat16 tensor of shape {shape} (kernels.cpu_pair_linear.pack)",
            )
        cache_shape = (layer.k_cache.shape[0], self.stack.block_size, self.num_kv_heads, self.stack.head_dim)
        for name in ("k_cache", "v_cache"):
            cache = getattr(layer, name)
            if self.stack.kv_int8 != isinstance(cache, Int8Cache):
                kind = (
                    "an int8 cache (Int8Cache)"
                    if self.stack.kv_int8
                    else f"a {dtype_name(self.dtype)} tensor"
                )
                raise ValueError(f"layers[{index}].{name}: this stack's build reads {kind}")
            if isinstance(cache, Int8Cache):
                cache.check()
            stored_dtype = torch.int8 if self.stack.kv_int8 else self.dtype
            require_contiguous(cache_rows(cache), f"layers[{index}].{name}", cache_shape, stored_dtype)

    def run(
        self,
        x: torch.Tensor,  # [rows, hidden]: the first layer's normed input; overwritten
        residual: torch.Tensor,  # [rows, hidden]: updated in place
        cos: torch.Tensor,  # [rows, head_dim / 2] float32, rounded to the dtype (CpuFusedOps.cos_sin)
        sin: torch.Tensor,
        slots: torch.Tensor,  # [rows] int64
        block_tables: torch.Tensor,  # [rows, max_blocks] int32, checked (check_block_tables)
        context_lens: torch.Tensor,  # [rows] int32
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:  # x, holding the final norm of the residual
        """One decode token per row through every layer. Block ids and context lengths are trusted
        (check them once per batch); slots are checked against the cache.

        `between_layers`: work to do at layer boundaries (the worker's urgent steps). Called after
        every layer (one C call per layer), unless it carries `pending`, a ctypes.c_int32 that
        another thread sets while it has work: then all layers run in one call that stops only at
        a boundary where `pending` is set, and `between_layers` (which clears it) runs there."""
        self._check_step(x, residual, cos, sin, slots, block_tables, context_lens)
        rows = x.shape[0]
        step = _Step(
            rows,
            self.hidden,
            self.num_kv_heads,
            self.ffn,
            block_tables.shape[1],
            self.eps,
            self.stack.head_dim**-0.5,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            self._scratch_buffer().data_ptr(),
        )
        return self._through_layers(step, x, residual, between_layers)

    def _check_step(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> None:
        """`run`'s arguments, their shapes, dtypes and layouts; and every slot inside the cache."""
        require_contiguous(x, "x", ("rows", self.hidden), self.dtype)
        rows = x.shape[0]
        require(1 <= rows <= self.max_rows, "x", x, f"1..{self.max_rows} rows")
        require_contiguous(residual, "residual", (rows, self.hidden), self.dtype)
        half = self.stack.head_dim // 2
        require_contiguous(cos, "cos", (rows, half), torch.float32)
        require_contiguous(sin, "sin", (rows, half), torch.float32)
        require_contiguous(slots, "slots", (rows,), torch.int64)
        if int(slots.min()) < 0 or int(slots.max()) >= self.num_slots:
            raise ValueError(f"slots: expected each in [0, {self.num_slots}), got {slots.tolist()}")
        require_contiguous(block_tables, "block_tables", (rows, "max_blocks"), torch.int32)
        require_contiguous(context_lens, "context_lens", (rows,), torch.int32)

    def _through_layers(
        self,
        step: _Step,
        x: torch.Tensor,
        residual: torch.Tensor,
        between_layers: Callable[[], None] | None,
    ) -> torch.Tensor:
        """The C calls over the layers: one for all of them, or as `run` says of `between_layers`."""
        threads = torch.get_num_threads()
        function = self.stack.function
        base, step_address = ctypes.addressof(self._layers), ctypes.addressof(step)
        size, count = ctypes.sizeof(_Layer), len(self._tensors)
        if between_layers is None:
            function(base, count, step_address, x.data_ptr(), residual.data_ptr(), threads, None)
            return x
        pending: ctypes.c_int32 | None = getattr(between_layers, "pending", None)
        if pending is None:
            for index in range(count):
                function(
                    base + index * size, 1, step_address, x.data_ptr(), residual.data_ptr(), threads, None
                )
                between_layers()
            return x
        done = 0
        while done < count:
            done += function(
                base + done * size,
                count - done,
                step_address,
                x.data_ptr(),
                residual.data_ptr(),
                threads,
                ctypes.addressof(pending),
            )
            if pending.value:
                between_layers()
        return x

    def _scratch_buffer(self) -> torch.Tensor:
        """Per thread (two lanes may decode at once), sized for max_rows rows."""
        scratch: torch.Tensor | None = getattr(self._scratch, "buffer", None)
        if scratch is None:
            per_row = self.q_size + 2 * self.kv_size + 2 * self.q_size + 3 * self.ffn + self.hidden
            scratch = torch.empty(self.max_rows * per_row, dtype=self.dtype)
            self._scratch.buffer = scratch
        return scratch


class CpuDecodeStack:
    """The loaded kernel for one attention shape (head_dim, group, block_size) and one linear."""

    def __init__(
        self,
        function: Callable[..., int],
        head_dim: int,
        group: int,
        block_size: int,
        pair_engine: str | None,
        blocks: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        kv_int8: bool = False,
    ) -> None:
        self.function = function
        # What the pair-layout linear multiplies on in this build (None for the block build): bind
        # weights packed for cpu_pair_linear's kernel of the same engine, so the stack's bits are
        # the per-op path's.
        self.pair_engine = pair_engine
        self.blocks = blocks  # on GGUF blocks, not on pairs (which are bfloat16)
        self.dtype = dtype
        self.kv_int8 = kv_int8  # its KV cache is int8 rows and scales (kernels/kv_int8.py)
        self.max_rows = BLOCK_STACK_MAX_ROWS if blocks else cpu_pair_linear.MAX_ROWS
        self.head_dim = head_dim
        self.group = group
        self.block_size = block_size

    def bind(self, layers: Sequence[StackLayer], eps: float) -> BoundStack:
        if not layers:
            raise ValueError("layers: expected at least one decoder layer, got none")
        return BoundStack(self, layers, eps)


def load_cpu_decode_stack(
    head_dim: int,
    group: int,
    block_size: int,
    allow_amx: bool = True,
    blocks: bool = False,
    vector_bits: int = 512,
    dtype: torch.dtype | None = None,
    kv_int8: bool = False,
) -> CpuDecodeStack:
    """Build (or find in the cache) and load the stack for this attention shape: in bfloat16, its
    pair-layout linear on AMX tiles where they run and `allow_amx`, else on AVX-512 BF16; with
    `blocks`, on GGUF blocks (AVX2, FMA and F16C) in `dtype`: float32 (the default) or bfloat16.
    `vector_bits` caps its decode attention's intrinsics path, as in kernels/cpu_decode.py (for
    the benchmarks' A/B). `kv_int8`: over an int8 KV cache (kernels/kv_int8.py)."""
    dtype = dtype or (torch.float32 if blocks else torch.bfloat16)
    if dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.float32 and not blocks):
        raise KernelBuildError(
            f"no CPU decode stack in {dtype} {'on GGUF blocks' if blocks else 'on pair-layout weights'}"
        )
    if vector_bits not in VECTOR_BITS:
        raise KernelBuildError(f"vector_bits={vector_bits}; supported: {VECTOR_BITS}")
    if not (
        8 <= head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
        and 1 <= group <= MAX_GROUP
        and 1 <= block_size <= MAX_BLOCK_SIZE
    ):
        raise KernelBuildError(
            f"no CPU decode stack for head_dim={head_dim}, group={group}, block_size={block_size}"
        )
    key = (head_dim, group, block_size, allow_amx, blocks, vector_bits, dtype, kv_int8)
    shape = {
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "BLOCK": block_size,
        "VECTOR_BITS": vector_bits,
        "KV_INT8": int(kv_int8),
    }
    with _lock:
        if key not in _loaded:
            engine: str | None
            if blocks:
                missing = [flag for flag in ("avx2", "fma", "f16c") if not cpu_has(flag)]
                if missing:
                    raise KernelBuildError(f"the block-linear decode stack needs {', '.join(missing)}")
                bf16 = int(dtype == torch.bfloat16)
                library = load(build("decode_stack.c", {**shape, "ELEM_BF16": bf16, "BLOCK_LINEAR": 1}))
                # Its linears call the block linear's own library (built once for every shape).
                library.duoserve_decode_stack_use_block_linear.argtypes = [ctypes.c_void_p]
                library.duoserve_decode_stack_use_block_linear(block_linear_entry(dtype))
                engine = None
            else:
                library, engine = load_engine(
                    "decode_stack.c", {**shape, "ELEM_BF16": 1}, "duoserve_pair_linear_uses_amx", allow_amx
                )
            function = library.duoserve_decode_stack
            function.restype = ctypes.c_int64  # layers run
            function.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_void_p,
            ]
            _loaded[key] = CpuDecodeStack(
                function, head_dim, group, block_size, engine, blocks, dtype, kv_int8
            )
        return _loaded[key]


__all__ = ["BoundStack", "CpuDecodeStack", "KernelBuildError", "StackLayer", "load_cpu_decode_stack"]

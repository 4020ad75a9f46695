"""The decoder layer's small ops on the CPU in one C pass each (kernels/cpu/fused_ops.c).

`CpuFusedOps` offers what the Triton path offers on CUDA (kernels/fused_ops.py), with the same
signatures and the same rounding, so the model's fused forward runs on either: residual add +
RMSNorm, rotary embedding in place, SiLU-and-multiply, and the paged KV write; and, for greedy
sampling, each row's argmax read in the element type (no float32 copy of the logits first), and
for sampling, each row's draw after temperature, top-k, top-p and min-p in one call, none of
them sorting the row. On the CPU each
torch op costs a dispatch and a pass over memory; a decoder layer's norms, rotary, activation
and KV write were ~40 of them. Built per element type (float32, bfloat16) on first use
(kernels/cpu_build.py).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kernels._launch import require, require_tensor, require_token_rows
from kernels.cpu_build import KernelBuildError, build, load
from kernels.kv_int8 import Int8Cache, check_write

DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_loaded: dict[torch.dtype, CpuFusedOps] = {}

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "duoserve_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _INT],
    "duoserve_rms_norm": [_P, _P, _P, _I, _I, _F, _INT],
    "duoserve_silu_and_mul": [_P, _P, _I, _I, _INT],
    "duoserve_rotary": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _INT],  # cos, sin tables
    "duoserve_write_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _INT],
    "duoserve_write_kv_int8": [_P, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _INT],
    "duoserve_dequantize_kv_int8": [_P, _P, _P, _I, _I, _I, _I, _P, _INT],
    "duoserve_argmax_rows": [_P, _I, _I, _P, _INT],
    "duoserve_logprobs": [_P, _I, _I, _P, _I, _P, _P, _P, _INT],
    "duoserve_draw": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _INT],
}

_RETURNS_STATUS = {"duoserve_draw"}  # 0, or 1 where its scratch could not be allocated


def _require_tensor(
    tensor: torch.Tensor, name: str, *, dims: int, dtypes: tuple[torch.dtype, ...] = DTYPES
) -> None:
    require_tensor(tensor, name, dims=dims, dtypes=dtypes, cpu=True)


def _require_rows(tensor: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """[T, heads, D] CPU rows of `dtype`, which may be strided (views into qkv), each row packed."""
    require_token_rows(tensor, name, cpu=True)
    require(tensor.dtype == dtype, name, tensor, f"{dtype}")


class CpuFusedOps:
    """The fused ops for one element type; each checks its inputs, then makes one C call."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype = ctypes.c_int if name in _RETURNS_STATUS else None
            function.argtypes = argtypes
        self._lib = library
        # cos/sin of the last positions rotated, per thread: every layer of a step rotates by the same.
        self._angles = threading.local()

    def _require_matrix(self, tensor: torch.Tensor, name: str, cols: int | None = None) -> None:
        _require_tensor(tensor, name, dims=2)
        require(
            tensor.dtype == self.dtype and tensor.device.type == "cpu", name, tensor, f"{self.dtype} on cpu"
        )
        if cols is not None:
            require(tensor.shape[1] == cols, name, tensor, f"{cols} columns")

    def _require_logits(self, x: torch.Tensor) -> None:
        """Logits read in place: contiguous rows of this build's dtype, at least one column."""
        self._require_matrix(x, "x")
        require(x.shape[1] > 0 and x.is_contiguous(), "x", x, "contiguous rows of at least one column")

    def _require_norm(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        self._require_matrix(x, "x")
        _require_tensor(weight, "weight", dims=1)
        require(weight.shape[0] == x.shape[1] and weight.dtype == x.dtype, "weight", weight, "[C] like x")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, C]
        """RMSNorm(x) * weight, as the torch RMSNorm module computes it."""
        self._require_norm(x, weight)
        out = torch.empty_like(x)
        self._lib.duoserve_rms_norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:  # [T, C]
        """residual += x (in place); returns RMSNorm(residual) * weight."""
        self._require_norm(x, weight)
        self._require_matrix(residual, "residual", x.shape[1])
        require(residual.shape == x.shape, "residual", residual, f"like x {tuple(x.shape)}")
        out = torch.empty_like(x)
        self._lib.duoserve_add_rms_norm(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            torch.get_num_threads(),
        )
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2F] → [T, F]
        self._require_matrix(gate_up, "gate_up")
        require(gate_up.shape[1] % 2 == 0, "gate_up", gate_up, "an even number of columns (gate then up)")
        tokens, ffn = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(tokens, ffn)
        self._lib.duoserve_silu_and_mul(
            gate_up.data_ptr(), out.data_ptr(), tokens, ffn, torch.get_num_threads()
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # [R, C] → [R] int64
        """Each row's first largest element, as torch's `x.max(dim=-1).indices` (a NaN counts as
        the largest value, -0 equals +0)."""
        self._require_logits(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._lib.duoserve_argmax_rows(
            x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads()
        )
        return out

    def logprobs(
        self, x: torch.Tensor, chosen: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [R] float32, [R, n] float32, [R, n] int64
        """log_softmax of each row of `x` (float32 results, the sum taken in float64) at its `chosen`
        token, and its `n` best tokens' (best first, ties in token-id order) with their ids, without
        writing the row's log-probabilities out. `x`: [R, C] contiguous logits of this build's
        dtype; 0 <= n <= C."""
        self._require_logits(x)
        _require_tensor(chosen, "chosen", dims=1, dtypes=(torch.int64,))
        require(chosen.shape[0] == x.shape[0], "chosen", chosen, f"{x.shape[0]} entries")
        if not 0 <= n <= x.shape[1]:
            raise ValueError(f"n: expected 0 to {x.shape[1]}, got {n}")
        chosen_lp = torch.empty(x.shape[0], dtype=torch.float32)
        top_lp = torch.empty(x.shape[0], n, dtype=torch.float32)
        top_ids = torch.empty(x.shape[0], n, dtype=torch.int64)
        self._lib.duoserve_logprobs(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            chosen.data_ptr(),
            n,
            chosen_lp.data_ptr(),
            top_lp.data_ptr(),
            top_ids.data_ptr(),
            torch.get_num_threads(),
        )
        return chosen_lp, top_lp, top_ids

    def draw(
        self,
        scores: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:  # [R] int64
        """One token per row from softmax(scores / temperature) after top-k (0: off; every token
        tied with the k-th kept too), top-p (the smallest set of the best of what top-k kept that
        holds top_p of its mass, every token tied with its last kept too) and min-p (weights
        exp((score - best) / temperature) below it dropped): the first token, in token-id order,
        whose running total of kept weights passes `uniform` times their total. `scores`: float32 rows; the
        others [R], top_k int64, the rest float32 (temperature > 0, uniform in [0, 1))."""
        _require_tensor(scores, "scores", dims=2, dtypes=(torch.float32,))  # in either element type's build
        require(scores.shape[1] > 0, "scores", scores, "rows of at least one column")
        per_row = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
            "uniform": uniform,
        }
        for name, values in per_row.items():
            dtype = torch.int64 if name == "top_k" else torch.float32
            _require_tensor(values, name, dims=1, dtypes=(dtype,))
            require(values.shape[0] == scores.shape[0], name, values, f"{scores.shape[0]} entries")
        tokens = torch.empty(scores.shape[0], dtype=torch.int64)
        failed = self._lib.duoserve_draw(
            scores.data_ptr(),
            scores.shape[0],
            scores.shape[1],
            *(values.data_ptr() for values in per_row.values()),
            tokens.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("draw: its scratch memory could not be allocated")
        return tokens

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> None:
        """Rotate q [T, H, D] and k [T, Hkv, D] in place; each token's heads and dims must be contiguous."""
        _require_rows(q, "q", self.dtype)
        _require_rows(k, "k", self.dtype)
        _require_tensor(positions, "positions", dims=1, dtypes=(torch.int64,))
        _require_tensor(inv_freq, "inv_freq", dims=1, dtypes=(torch.float32,))
        head_dim = q.shape[2]
        require(k.shape[2] == head_dim and head_dim % 2 == 0, "k", k, f"head_dim {head_dim} (even) like q")
        require(inv_freq.shape[0] == head_dim // 2, "inv_freq", inv_freq, f"{head_dim // 2} frequencies")
        require(
            positions.shape[0] == q.shape[0] == k.shape[0], "positions", positions, f"{q.shape[0]} entries"
        )
        cos, sin = self.cos_sin(positions, inv_freq)
        self._lib.duoserve_rotary(
            q.data_ptr(),
            q.stride(0),
            q.shape[1],
            k.data_ptr(),
            k.stride(0),
            k.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            q.shape[0],
            head_dim // 2,
            torch.get_num_threads(),
        )

    def cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D / 2] float32 tables, rounded to the element type as torch's rope rounds them; computed
        once per step (the same positions tensor), not once per layer."""
        last = getattr(self._angles, "last", None)
        if last is not None and last[0] is positions and last[1] is inv_freq:
            return last[2], last[3]
        angles = positions.float()[:, None] * inv_freq[None, :]
        cos = angles.cos().to(self.dtype).float().contiguous()
        sin = angles.sin().to(self.dtype).float().contiguous()
        self._angles.last = (positions, inv_freq, cos, sin)
        return cos, sin

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]; rows may be strided (a view into qkv)
        v: torch.Tensor,
        k_cache: torch.Tensor | Int8Cache,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor | Int8Cache,
        slot_mapping: torch.Tensor,  # [T] int64; slots < 0 are skipped
    ) -> None:
        """Copy each token's rows to its slot; into an int8 cache, quantized (kernels/kv_int8.py)."""
        if isinstance(k_cache, Int8Cache) or isinstance(v_cache, Int8Cache):
            self._write_kv_int8(k, v, k_cache, v_cache, slot_mapping)
            return
        _require_rows(k, "k", self.dtype)
        _require_rows(v, "v", self.dtype)
        require(v.shape == k.shape, "v", v, f"shape {tuple(k.shape)}")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            _require_tensor(cache, name, dims=4)
            require(
                cache.shape[2:] == k.shape[1:] and cache.dtype == self.dtype,
                name,
                cache,
                f"[.., .., {k.shape[1]}, {k.shape[2]}] {self.dtype}",
            )
        require(v_cache.shape == k_cache.shape, "v_cache", v_cache, f"shape {tuple(k_cache.shape)}")
        _require_tensor(slot_mapping, "slot_mapping", dims=1, dtypes=(torch.int64,))
        require(slot_mapping.shape[0] == k.shape[0], "slot_mapping", slot_mapping, f"{k.shape[0]} entries")
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if k.shape[0] and int(slot_mapping.max()) >= num_slots:
            raise ValueError(f"slot_mapping: slots must be < {num_slots}, got {int(slot_mapping.max())}")
        self._lib.duoserve_write_kv(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            k.shape[0],
            k.shape[1] * k.shape[2],
            torch.get_num_threads(),
        )

    def dequantize_kv_int8(self, cache: Int8Cache, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rows at `slots` ([S] int64) times their scales, into `out` ([S, Hkv, D] of this dtype)."""
        cache.check()
        _, block_size, heads, dim = cache.shape
        _require_tensor(slots, "slots", dims=1, dtypes=(torch.int64,))
        require(
            out.shape == (slots.shape[0], heads, dim) and out.dtype == self.dtype and out.is_contiguous(),
            "out",
            out,
            f"contiguous [{slots.shape[0]}, {heads}, {dim}] {self.dtype}",
        )
        count = slots.shape[0]
        if count and (int(slots.min()) < 0 or int(slots.max()) >= cache.shape[0] * block_size):
            raise ValueError(f"slots: expected each in [0, {cache.shape[0] * block_size})")
        if count:
            self._lib.duoserve_dequantize_kv_int8(
                cache.values.data_ptr(),
                cache.scales.data_ptr(),
                slots.data_ptr(),
                count,
                heads,
                dim,
                block_size,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out

    def _write_kv_int8(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor | Int8Cache,
        v_cache: torch.Tensor | Int8Cache,
        slot_mapping: torch.Tensor,
    ) -> None:
        _require_rows(k, "k", self.dtype)
        _require_rows(v, "v", self.dtype)
        k_cache, v_cache = check_write(k, v, k_cache, v_cache, slot_mapping, cpu=True)
        block_size = k_cache.shape[1]
        self._lib.duoserve_write_kv_int8(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            k_cache.values.data_ptr(),
            v_cache.values.data_ptr(),
            k_cache.scales.data_ptr(),
            v_cache.scales.data_ptr(),
            slot_mapping.data_ptr(),
            k.shape[0],
            k.shape[1],
            k.shape[2],
            block_size,
            torch.get_num_threads(),
        )


def load_cpu_fused_ops(dtype: torch.dtype) -> CpuFusedOps:
    """Build (or find in the cache) and load the ops for `dtype`; KernelBuildError if impossible."""
    if dtype not in DTYPES:
        raise KernelBuildError(f"no CPU fused ops for {dtype}; supported: {DTYPES}")
    with _lock:
        if dtype not in _loaded:
            path = build("fused_ops.c", {"ELEM_BF16": int(dtype == torch.bfloat16)})
            _loaded[dtype] = CpuFusedOps(load(path), dtype)
        return _loaded[dtype]

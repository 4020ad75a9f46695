"""Llama-family decoder over a paged KV cache (SmolLM, Llama 2/3, Mistral-style GQA, Qwen2 qkv bias).

Weights are stored fused: q/k/v as one [(H + 2 Hkv) * Dh, hidden] matrix and gate/up as one
[2 * ffn, hidden] matrix, so each layer runs four matmuls. Only the rows named by
`batch.logits_indices` go through the final norm and the LM head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention import FusedOps, TorchPagedAttention, TritonPagedAttention
from gpu_worker.batch import ForwardBatch
from gpu_worker.kv_cache import LayerCache
from gpu_worker.linear import (
    GateUpLinear,
    Linear,
    blocks_take,
    packed_linear_available,
    pair_kernel,
    small_steps_take_blocks,
)
from gpu_worker.model_config import ModelConfig
from gpu_worker.stack_binding import StackBinding
from kernels.block_weights import Blocks, BlockWeight, concat_rows
from kernels.cpu_fused import CpuFusedOps
from kernels.cpu_pair_linear import PairLinear

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# A layer's blocks (as its files store the weights) for qkv, o, gate/up and down, each None where it has none.
LayerBlocks = tuple[Blocks | None, Blocks | None, Blocks | None, Blocks | None]


def _empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _shape_only(weight: torch.Tensor) -> nn.Parameter:
    """A parameter of `weight`'s shape and dtype without storage (on the "meta" device)."""
    return _empty_param(tuple(weight.shape), weight.dtype, torch.device("meta"))


def _release_unread(owners: Sequence[tuple[nn.Module, str, Linear]]) -> int:
    """Hold as shapes alone the weights that no step reads, each named by its module and attribute
    beside the linear that multiplies on it (see LlamaModel.release_unread_weights); bytes released."""
    released = 0
    for module, attr, linear in owners:
        weight = getattr(module, attr)
        if weight.is_meta or linear.weight is not weight or linear.reads_weight:
            continue
        shape = _shape_only(weight)
        setattr(module, attr, shape)
        linear.weight = shape
        released += weight.numel() * weight.element_size()
    return released


class RMSNorm(nn.Module):
    """RMS norm computed in float32 and cast back, as the reference Llama implementation does."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param((size,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [Dh / 2] float32
    """Rotary inverse frequencies, with Llama 3 frequency scaling applied when configured."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    original = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # each [T, 1, Dh / 2]
    """cos/sin of position * frequency, computed in float32 then cast (shared by every layer)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh / 2]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, heads, Dh]
    """Rotate the half-split pairs (x[j], x[j + Dh/2]) by their angles (HF "rotate_half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, heads, Dh / 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and SwiGLU MLP block, each with a residual connection."""

    def __init__(
        self,
        config: ModelConfig,
        attention: TorchPagedAttention | TritonPagedAttention,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.attention = attention
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.qkv_weight = _empty_param((self.q_size + 2 * self.kv_size, h), dtype, device)
        self.qkv_bias = (
            _empty_param((self.q_size + 2 * self.kv_size,), dtype, device) if config.attention_bias else None
        )
        self.o_weight = _empty_param((h, self.q_size), dtype, device)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.gate_up_weight = _empty_param((2 * config.intermediate_size, h), dtype, device)
        self.down_weight = _empty_param((h, config.intermediate_size), dtype, device)
        self.prepare_linears(packed=False)

    def prepare_linears(
        self,
        packed: bool,
        pair: PairLinear | None = None,
        blocks: LayerBlocks | None = None,
        self_blocks: bool = False,
    ) -> None:
        """Bind the four matmuls to the current weights (call again after loading them); `blocks`
        gives the file's blocks of each (or None) for the block kernel, and with `self_blocks`
        bfloat16 weights without quantized blocks multiply on themselves there (see Linear)."""
        qkv, o, gate_up, down = blocks or (None, None, None, None)
        self.qkv = Linear(self.qkv_weight, self.qkv_bias, packed, pair, qkv, self_blocks)
        self.o_proj = Linear(self.o_weight, None, packed, pair, o, self_blocks)
        self.gate_up = GateUpLinear(self.gate_up_weight, packed, pair, gate_up, self_blocks)
        self.down = Linear(self.down_weight, None, packed, pair, down, self_blocks)

    def release_unread_weights(self) -> int:
        """LlamaModel.release_unread_weights for this layer's four weights; bytes released."""
        return _release_unread(
            [
                (self, "qkv_weight", self.qkv),
                (self, "o_weight", self.o_proj),
                (self, "gate_up_weight", self.gate_up),
                (self, "down_weight", self.down),
            ]
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, Dh / 2]
        sin: torch.Tensor,
        kv_cache: LayerCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, hidden]
        hidden = self.attention_block(hidden, cos, sin, kv_cache, batch)
        return self.mlp_block(hidden)

    def attention_block(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [T, hidden]
        return hidden + self._attention(self.input_layernorm(hidden), cos, sin, kv_cache, batch)

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return hidden + self._mlp(self.post_attention_layernorm(hidden))

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden]: input_layernorm(residual), already applied
        residual: torch.Tensor,  # [T, hidden]: updated in place
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        kv_cache: LayerCache,
        batch: ForwardBatch,
        next_norm: RMSNorm,
        ops: FusedOps,
    ) -> torch.Tensor:  # next_norm(residual) after this layer
        """The fused path: residual adds fused into the norms, rotary in place, fused SiLU-and-mul."""
        tokens = x.shape[0]
        qkv = self.qkv(x)
        q = qkv[:, : self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        ops.rotary_embedding(q, k, positions, inv_freq)
        attn = self.o_proj(self.attention(q, k, v, kv_cache, batch))
        x = ops.fused_add_rms_norm(
            attn, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps
        )
        mlp = self.down(
            self.gate_up.silu_and_mul(x, ops.silu_and_mul, c_rounding=isinstance(ops, CpuFusedOps))
        )
        return ops.fused_add_rms_norm(mlp, residual, next_norm.weight, next_norm.eps)

    def _attention(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(x)  # [T, (H + 2 Hkv) * Dh]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(tokens, self.num_heads, self.head_dim), cos, sin)  # [T, H, Dh]
        k = apply_rope(k.view(tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, Dh]
        v = v.view(tokens, self.num_kv_heads, self.head_dim)  # strided view into qkv; index_copy_ handles it
        out = self.attention(q, k, v, kv_cache, batch)  # [T, H * Dh]
        return self.o_proj(out)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] → [T, hidden]
        return self.down(self.gate_up.silu_and_mul(x, _silu_and_mul))


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 ffn] → [T, ffn]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaModel(nn.Module):
    """Llama-family causal LM whose forward reads and writes a paged KV cache."""

    inv_freq: torch.Tensor  # [Dh / 2] float32 buffer

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        small_batch_linears: bool = True,
    ) -> None:
        """`small_batch_linears`: in bfloat16 on the CPU, decode-sized steps take duoserve's own
        linear kernels where they build (gpu_worker/linear.py), and the decode stack."""
        super().__init__()
        self.small_batch_linears = small_batch_linears
        device = torch.device(device)
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype {dtype} is unsupported; choose one of {SUPPORTED_DTYPES}")
        if dtype == torch.float16 and device.type != "cuda":
            raise ValueError("dtype float16 needs a CUDA device; use float32 or bfloat16 on CPU")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention: TorchPagedAttention | TritonPagedAttention = TorchPagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim
        )
        self.embed_tokens = _empty_param((config.vocab_size, config.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.attention, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _empty_param((config.vocab_size, config.hidden_size), dtype, device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        self.lm_head_linear = Linear(self.lm_head, None, packed=False)
        self.stack_binding = StackBinding()  # on the CPU backend, decode steps in one C call

    @property
    def attention_backend(self) -> str:
        return self.attention.name

    @property
    def fused_ops(self) -> FusedOps | None:
        """The backend's fused ops, when forward takes the fused path (norms, rotary, SiLU-and-mul)."""
        return self.attention.fused_ops

    def use_attention(self, attention: TorchPagedAttention | TritonPagedAttention) -> None:
        """Swap the attention backend of every layer (the worker picks it once the block size is known)."""
        self.attention = attention
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.attention = attention

    @torch.inference_mode()
    def load_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        blocks: Mapping[str, BlockWeight] | None = None,
        consume: bool = False,
    ) -> int:
        """Copy HF-named tensors (as returned by `load_model`) into the fused parameters. `blocks`
        (from `load_block_weights`, the same files'; None: no block kernel) lets CPU linears take the
        block kernel where `blocks_take` (gpu_worker/linear.py) says so; in bfloat16 there, every
        linear without quantized blocks multiplies on its own weight on it. Where the CPU
        multiplies bfloat16, steps of up to SMALL_STEP_ROWS rows take the quantized blocks
        (`small_steps_take_blocks`). Weights left unread (`load_model`'s `shape_only`, chosen from
        `blocks_only_weights`) are held as shapes only and their linears multiply on the blocks at
        every step.

        `consume` (the worker's load, of a state dict it needs no more): each tensor leaves
        `state_dict` once copied in, and each layer's weights that no step reads are released as
        soon as its linears are packed (`release_unread_weights`). The load then holds about one
        layer's dense weights beside what the model keeps, where it would otherwise hold the state
        dict, the parameters and the packed copies whole. Returns the bytes released (0 without
        `consume`)."""

        def take(name: str) -> torch.Tensor:
            assert name in state_dict, f"weight {name!r} missing from the state dict"
            if consume:
                assert isinstance(state_dict, MutableMapping), "consume takes the tensors out of a dict"
                return state_dict.pop(name)
            return state_dict[name]

        def fill(module: nn.Module, attr: str, names: Sequence[str]) -> None:
            """Copy the named tensors, stacked by rows, into the parameter; tensors left unread
            (on the "meta" device) leave it a shape without storage."""
            parts = [take(name) for name in names]
            if any(part.is_meta for part in parts):
                if not all(part.is_meta for part in parts):
                    raise ValueError(f"weights {list(names)} were read only in part")
                setattr(module, attr, _shape_only(getattr(module, attr)))
                return
            getattr(module, attr).copy_(torch.cat(parts) if len(parts) > 1 else parts[0])

        embedding = "model.embed_tokens.weight"
        if embedding in state_dict and state_dict[embedding].is_meta:
            raise ValueError(f"{embedding} must be read: the embedding looks its rows up")
        fill(self, "embed_tokens", [embedding])
        self.norm.weight.copy_(take("model.norm.weight"))
        if not self.config.tie_word_embeddings:
            fill(self, "lm_head", ["lm_head.weight"])
        # How the linears multiply, bound to each layer's weights once they are in: the packed
        # copies are taken of the loaded values.
        packed = packed_linear_available(self.dtype, self.device)
        # Pair layouts are bfloat16: float32 linears take oneDNN's packed kernel at every size.
        own = packed and self.dtype == torch.bfloat16 and self.small_batch_linears
        pair = pair_kernel() if own else None
        takes_blocks = blocks is not None and blocks_take(self.dtype, self.device)
        self_blocks = takes_blocks and self.dtype == torch.bfloat16
        small_steps = small_steps_take_blocks(self.dtype, self.device)  # beside the pair layouts
        blocks = blocks if blocks and (takes_blocks or small_steps) else {}
        released = 0
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            qkv, o, gate_up, down = _layer_weight_names(p)
            fill(layer, "qkv_weight", qkv)
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([take(name.replace(".weight", ".bias")) for name in qkv]))
            fill(layer, "o_weight", o)
            fill(layer, "gate_up_weight", gate_up)
            fill(layer, "down_weight", down)
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            layer.prepare_linears(packed, pair, _layer_blocks(blocks, p), self_blocks)
            if consume:
                released += layer.release_unread_weights()
        head = embedding if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head_linear = Linear(self.lm_head, None, packed, pair, blocks.get(head), self_blocks)
        if consume:
            released += self._release_unread_head()
        return released

    def release_unread_weights(self) -> int:
        """Hold as shapes alone the dense weights that no step reads (`Linear.reads_weight`: those
        of packed linears, which multiply on the copies packed from them), so that their memory is
        freed; bytes released. A tied LM head's weight is the embedding's, which is looked up, and
        stays. The worker's load does this layer by layer (`load_weights`' `consume`); tests and
        benchmarks that read the weights do not."""
        released = sum(layer.release_unread_weights() for layer in self.decoder_layers())
        return released + self._release_unread_head()

    def _release_unread_head(self) -> int:
        if self.config.tie_word_embeddings:
            return 0
        return _release_unread([(self, "lm_head", self.lm_head_linear)])

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def linears(self) -> list[Linear]:
        """Every linear: the LM head, then each layer's qkv, o, gate/up and down."""
        found = [self.lm_head_linear]
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            found += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
        return found

    @property
    def block_linears(self) -> int:
        """How many of the linears have blocks for the block kernel."""
        return sum(lin.blocks is not None for lin in self.linears())

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: Sequence[LayerCache],
        yield_point: Callable[[], None] | None = None,
    ) -> torch.Tensor:  # [S, vocab] in the model's dtype
        """Run one step: write every token's K/V, return logits for `batch.logits_indices` rows only,
        in the model's dtype, as the head computes them (the sampler converts them where it must).

        `yield_point` is called between blocks (after each attention and each MLP block): the
        worker runs urgent steps there, on other sequences, while this one waits.
        """
        assert len(kv_caches) == len(self.layers), f"{len(kv_caches)} KV caches for {len(self.layers)} layers"
        hidden = F.embedding(batch.input_ids, self.embed_tokens)  # [T, hidden]
        if self.fused_ops is not None:
            return self._forward_fused(hidden, batch, kv_caches, self.fused_ops, yield_point)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            if yield_point is None:
                hidden = layer(hidden, cos, sin, kv_cache, batch)
                continue
            hidden = layer.attention_block(hidden, cos, sin, kv_cache, batch)
            yield_point()
            hidden = layer.mlp_block(hidden)
            yield_point()
        hidden = hidden.index_select(0, batch.logits_indices)  # [S, hidden]
        return self.lm_head_linear(self.norm(hidden))  # [S, vocab]

    def _forward_fused(
        self,
        residual: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: Sequence[LayerCache],
        ops: FusedOps,
        yield_point: Callable[[], None] | None,
    ) -> torch.Tensor:  # [S, vocab]
        layers = self.decoder_layers()
        x = layers[0].input_layernorm(residual)
        stacked = self.stack_binding.run(self, x, residual, batch, kv_caches, yield_point)
        if stacked is not None:
            x = stacked
        else:
            norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
            for layer, kv_cache, next_norm in zip(layers, kv_caches, norms, strict=True):
                x = layer.forward_fused(
                    x, residual, batch.positions, self.inv_freq, kv_cache, batch, next_norm, ops
                )
                if yield_point is not None:
                    yield_point()
        return self.lm_head_linear(x.index_select(0, batch.logits_indices))


def _layer_weight_names(prefix: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """The Hugging Face names of one layer's qkv, o, gate/up and down weights, in the order they
    are stacked by rows."""
    return (
        [prefix + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v")],
        [prefix + "self_attn.o_proj.weight"],
        [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"],
        [prefix + "mlp.down_proj.weight"],
    )


def _stacked_blocks(blocks: Mapping[str, BlockWeight], names: Sequence[str]) -> Blocks | None:
    """The named weights' blocks stacked by rows (as parts where their types differ), or None
    unless all have blocks."""
    parts = [blocks.get(name) for name in names]
    present = [p for p in parts if p is not None]
    return concat_rows(present) if len(present) == len(parts) else None


def _layer_blocks(blocks: Mapping[str, BlockWeight], prefix: str) -> LayerBlocks | None:
    """One layer's blocks, fused as its parameters are (q/k/v and gate/up stacked by rows)."""
    if not blocks:
        return None
    qkv, o, gate_up, down = (_stacked_blocks(blocks, names) for names in _layer_weight_names(prefix))
    return qkv, o, gate_up, down


def blocks_only_weights(config: ModelConfig, blocks: Mapping[str, BlockWeight]) -> set[str]:
    """The weights whose linears can multiply on `blocks` alone (see `load_weights`): each layer's
    q/k/v, o, gate/up and down where all of a fused linear's parts have blocks, and an
    untied LM head with blocks. A tied head's blocks are the embedding's, whose rows are looked up,
    so it is left out."""
    found: set[str] = set()
    for i in range(config.num_layers):
        for names in _layer_weight_names(f"model.layers.{i}."):
            if _stacked_blocks(blocks, names) is not None:
                found.update(names)
    if not config.tie_word_embeddings and "lm_head.weight" in blocks:
        found.add("lm_head.weight")
    return found

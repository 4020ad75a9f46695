"""A model's decode steps in one C call on the CPU: the decode stack (kernels/cpu_stack.py) bound to
the model's layers and KV caches.

A decode step of at most the stack's max_rows sequences on the CPU backend runs every layer in one
call: in bfloat16 with the pair-layout linears, or in the model's dtype with the files' GGUF
blocks; where the CPU multiplies bfloat16, steps of one or two sequences on the blocks' dot
products and the others on the pairs. The stack is bound on first use, to the KV caches of that step, and again whenever they
change; a model with a linear lacking the stack's kernel takes the per-op path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ForwardBatch
from gpu_worker.kv_cache import LayerCache
from gpu_worker.linear import SMALL_STEP_ROWS, Linear
from kernels.block_weights import Blocks
from kernels.cpu_stack import BoundStack, CpuDecodeStack, StackLayer
from kernels.kv_int8 import cache_rows

if TYPE_CHECKING:
    from gpu_worker.model import LlamaModel


def stack_layers(model: LlamaModel, kv_caches: Sequence[LayerCache], blocks: bool) -> list[StackLayer] | None:
    """Each decoder layer's tensors over these KV caches, as a decode stack binds them: with the
    linears' GGUF blocks (`blocks`) or their pair-layout weights; None where a linear has none."""
    layers = model.decoder_layers()
    norms = [layer.input_layernorm.weight for layer in layers[1:]] + [model.norm.weight]
    found: list[StackLayer] = []
    for layer, norm, (k_cache, v_cache) in zip(layers, norms, kv_caches, strict=True):
        four = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        pair = None if blocks else _pair_weights(*four)
        block = _block_weights(*four) if blocks else None
        if pair is None and block is None:
            return None
        found.append(
            StackLayer(
                qkv_weight=layer.qkv_weight.detach(),
                qkv_bias=None if layer.qkv_bias is None else layer.qkv_bias.detach(),
                o_weight=layer.o_weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up_weight=layer.gate_up_weight.detach(),
                down_weight=layer.down_weight.detach(),
                next_norm=norm.detach(),
                k_cache=k_cache,
                v_cache=v_cache,
                pair_weights=pair or (),
                block_weights=block or (),
            )
        )
    return found


class StackBinding:
    """One model's decode stacks, each bound to the KV caches it last ran on."""

    def __init__(self) -> None:
        # By stack: the key (stack, first cache, layers) it was bound for, and the bound stack; None
        # in its place: a linear has no weights for that stack's kernel, so it takes no steps.
        self._bound: dict[int, tuple[tuple[object, int, int], BoundStack | None]] = {}

    @property
    def unavailable(self) -> bool:
        """Bound and found the model can run on none of its stacks."""
        return bool(self._bound) and all(bound is None for _, bound in self._bound.values())

    def run(
        self,
        model: LlamaModel,
        x: torch.Tensor,
        residual: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: Sequence[LayerCache],
        yield_point: Callable[[], None] | None,
    ) -> torch.Tensor | None:
        """Every layer of `model` in one C call for a decode step of at most the stack's max_rows
        sequences on the CPU backend, the first layer's norm already applied to `x`; None (nothing
        done) for any other step. Steps of up to SMALL_STEP_ROWS sequences take the attention's
        small-step stack (on the blocks) where the model can run on it."""
        attention = model.attention
        if (
            not isinstance(attention, CpuPagedAttention)
            or attention.fused_ops is None
            or batch.decode is None
            or batch.prefills
        ):
            return None
        stack = None
        small = attention.small_decode_stack
        if small is not None and small.dtype == model.dtype and batch.num_tokens <= SMALL_STEP_ROWS:
            stack = self._bind(small, model, kv_caches)
        decode_stack = attention.decode_stack
        if (
            stack is None
            and decode_stack is not None
            and decode_stack.dtype == model.dtype
            and (decode_stack.blocks or model.small_batch_linears)
        ):
            stack = self._bind(decode_stack, model, kv_caches)
        if stack is None or batch.num_tokens > stack.max_rows:
            return None
        attention.check_once(batch.decode, kv_caches[0][0])
        cos, sin = attention.fused_ops.cos_sin(batch.positions, model.inv_freq)
        return stack.run(
            x,
            residual,
            cos,
            sin,
            batch.slot_mapping,
            batch.decode.block_tables,
            batch.decode.context_lens,
            yield_point,
        )

    def _bind(
        self,
        decode_stack: CpuDecodeStack,
        model: LlamaModel,
        kv_caches: Sequence[LayerCache],
    ) -> BoundStack | None:
        """`decode_stack` bound to these caches (again only when they changed); None where a linear
        has no weights for its kernel."""
        key = (decode_stack, cache_rows(kv_caches[0][0]).data_ptr(), len(kv_caches))
        bound = self._bound.get(id(decode_stack))
        if bound is None or bound[0] != key:
            layers = stack_layers(model, kv_caches, decode_stack.blocks)
            if layers is None:
                bound = (key, None)  # a linear without the stack's kernel
            else:
                engine = model.decoder_layers()[0].qkv.pair_engine
                if not decode_stack.blocks and engine != decode_stack.pair_engine:
                    raise ValueError(
                        f"decode stack: its pair-layout linear runs on {decode_stack.pair_engine}, "
                        f"the model's on {engine}"
                    )
                bound = (key, decode_stack.bind(layers, model.config.rms_norm_eps))
            self._bound[id(decode_stack)] = bound
        return bound[1]


def _pair_weights(*linears: Linear) -> tuple[torch.Tensor, ...] | None:
    """The linears' pair-layout weights, or None unless all of them have one."""
    weights = [linear.pair_weight for linear in linears]
    return None if any(w is None for w in weights) else tuple(w for w in weights if w is not None)


def _block_weights(*linears: Linear) -> tuple[Blocks, ...] | None:
    """The linears' blocks, or None unless all of them have them."""
    weights = [linear.blocks for linear in linears]
    return None if any(w is None for w in weights) else tuple(w for w in weights if w is not None)

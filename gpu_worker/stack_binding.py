"""A model's decode steps in one C call on the CPU: the decode stack (kernels/cpu_stack.py) bound to
the model's layers and KV caches.

A decode step of at most the stack's max_rows sequences on the CPU backend runs every layer in one
call: in bfloat16 with the pair-layout linears, or in the model's dtype with the files' GGUF
blocks. The stack is bound on first use, to the KV caches of that step, and again whenever they
change; a model with a linear lacking the stack's kernel takes the per-op path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ForwardBatch
from gpu_worker.linear import Linear
from kernels.block_weights import Blocks
from kernels.cpu_stack import BoundStack, StackLayer

if TYPE_CHECKING:
    from gpu_worker.model import LlamaModel


def stack_layers(
    model: LlamaModel, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], blocks: bool
) -> list[StackLayer] | None:
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
    """One model's decode stack, bound to the KV caches it last ran on."""

    def __init__(self) -> None:
        # The key (stack, first cache, layers) it was bound for, and the bound stack; None in its
        # place: a linear has no weights for the stack's kernel, so decode steps take the per-op path.
        self._bound: tuple[tuple[object, int, int], BoundStack | None] | None = None

    @property
    def unavailable(self) -> bool:
        """Bound once and found the model cannot run on the stack."""
        return self._bound is not None and self._bound[1] is None

    def run(
        self,
        model: LlamaModel,
        x: torch.Tensor,
        residual: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        yield_point: Callable[[], None] | None,
    ) -> torch.Tensor | None:
        """Every layer of `model` in one C call for a decode step of at most the stack's max_rows
        sequences on the CPU backend, the first layer's norm already applied to `x`; None (nothing
        done) for any other step."""
        attention = model.attention
        if (
            not isinstance(attention, CpuPagedAttention)
            or attention.decode_stack is None
            or attention.fused_ops is None
            or batch.decode is None
            or batch.prefills
        ):
            return None
        decode_stack = attention.decode_stack
        if decode_stack.dtype != model.dtype or not (decode_stack.blocks or model.small_batch_linears):
            return None
        key = (decode_stack, kv_caches[0][0].data_ptr(), len(kv_caches))
        if self._bound is None or self._bound[0] != key:
            layers = stack_layers(model, kv_caches, decode_stack.blocks)
            if layers is None:
                self._bound = (key, None)  # a linear without the stack's kernel
                return None
            engine = model.decoder_layers()[0].qkv.pair_engine
            if not decode_stack.blocks and engine != decode_stack.pair_engine:
                raise ValueError(
                    f"decode stack: its pair-layout linear runs on {decode_stack.pair_engine}, "
                    f"the model's on {engine}"
                )
            self._bound = (key, decode_stack.bind(layers, model.config.rms_norm_eps))
        stack = self._bound[1]
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


def _pair_weights(*linears: Linear) -> tuple[torch.Tensor, ...] | None:
    """The linears' pair-layout weights, or None unless all of them have one."""
    weights = [linear.pair_weight for linear in linears]
    return None if any(w is None for w in weights) else tuple(w for w in weights if w is not None)


def _block_weights(*linears: Linear) -> tuple[Blocks, ...] | None:
    """The linears' blocks, or None unless all of them have them."""
    weights = [linear.blocks for linear in linears]
    return None if any(w is None for w in weights) else tuple(w for w in weights if w is not None)

"""The decode stack on GGUF blocks (kernels/cpu_stack.py, blocks=True) against the per-op forward
it replaces, on SmolLM2-135M's own Q4_1/Q8_0 file: the same bits, the same KV cache. In float32,
and in bfloat16 where the CPU cannot multiply bfloat16 (there bfloat16 models take the blocks)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import KVCache, allocate_kv_cache
from gpu_worker.linear import block_kernel, cpu_multiplies_bfloat16
from gpu_worker.loader import ModelConfig, load_block_weights, load_model
from gpu_worker.model import LlamaModel
from gpu_worker.worker import make_attention
from kernels.cpu_block_linear import BF16, BlockWeight
from kernels.cpu_stack import BLOCK_STACK_MAX_ROWS
from scheduler.model_files import find_default_model
from tests.cpu_features import cpu_has
from tests.worker_steps import CountingRuns

CPU = torch.device("cpu")
BLOCK_SIZE = 16
CONTEXT = 40  # tokens already cached per sequence
SEQS = BLOCK_STACK_MAX_ROWS + 2  # more than the stack takes
BLOCKS_PER_SEQ = 4

pytestmark = pytest.mark.skipif(
    not all(cpu_has(flag) for flag in ("avx2", "fma", "f16c")),
    reason="the block kernel needs AVX2, FMA, F16C",
)
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            cpu_multiplies_bfloat16(),
            reason="this CPU multiplies bfloat16: bfloat16 linears take the pair-layout kernel, not blocks",
        ),
    ),
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]]:
    path = find_default_model()
    config, weights = load_model(path)
    return config, weights, load_block_weights(path, config)


def block_model(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    stack: bool,
    blocks: bool = True,
    vector_bits: int = 512,
    dtype: torch.dtype = torch.float32,
) -> LlamaModel:
    config, weights, block_weights = smollm2
    model = LlamaModel(config, dtype, CPU)
    model.load_weights(weights, block_weights if blocks else None)
    attention = make_attention("cpu", config, dtype, CPU, BLOCK_SIZE, vector_bits)
    assert isinstance(attention, CpuPagedAttention)
    assert attention.decode_stack is not None and attention.decode_stack.blocks
    assert attention.decode_stack.dtype == dtype
    if not stack:
        attention.decode_stack = None
    model.use_attention(attention)
    return model


def filled_cache(config: ModelConfig, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = allocate_kv_cache(config, SEQS * BLOCKS_PER_SEQ, BLOCK_SIZE, dtype, CPU)
    gen = torch.Generator().manual_seed(0)
    for k, v in cache:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return cache


def decode_batch(rows: int) -> Any:
    # Each sequence's blocks interleaved with the others', as sequences that decode together get them.
    chunks = [
        ScheduledChunk([5 + s], CONTEXT, [b * SEQS + s for b in range(BLOCKS_PER_SEQ)], True)
        for s in range(rows)
    ]
    return build_forward_batch(chunks, BLOCK_SIZE, CPU)


def test_the_worker_loads_it_here() -> None:
    assert block_kernel() is not None  # CPUs with AVX2, FMA and F16C: this module's skip says so


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 7, BLOCK_STACK_MAX_ROWS, BLOCK_STACK_MAX_ROWS + 1])
def test_the_stack_computes_the_per_op_forward_bit_for_bit(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    rows: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = smollm2[0]
    counting = CountingRuns(monkeypatch)
    stacked = block_model(smollm2, stack=True, dtype=dtype)
    per_op = block_model(smollm2, stack=False, dtype=dtype)
    stacked_cache, per_op_cache = filled_cache(config, dtype), filled_cache(config, dtype)
    batch = decode_batch(rows)
    got = stacked(batch, stacked_cache)
    want = per_op(batch, per_op_cache)
    # Past the stack's rows the per-op path runs (in float32 the weights' float32 copies, through
    # oneDNN; in bfloat16 still the blocks).
    assert counting.runs == (1 if rows <= BLOCK_STACK_MAX_ROWS else 0)
    assert got.dtype == dtype and torch.equal(got, want)
    for (k_a, v_a), (k_b, v_b) in zip(stacked_cache, per_op_cache, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


@pytest.mark.parametrize("vector_bits", [256, 0])
def test_on_each_decode_attention_path_the_stack_computes_the_per_op_forward(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    vector_bits: int,
) -> None:
    """--cpu-vector-bits reaches both the per-op kernel and the stack's own copy of it."""
    config = smollm2[0]
    stacked = block_model(smollm2, stack=True, vector_bits=vector_bits)
    per_op = block_model(smollm2, stack=False, vector_bits=vector_bits)
    attention = per_op.attention
    assert isinstance(attention, CpuPagedAttention) and attention.kernel.vector_path == vector_bits
    batch = decode_batch(5)
    got = stacked(batch, filled_cache(config))
    assert torch.equal(got, per_op(batch, filled_cache(config)))
    other = block_model(smollm2, stack=True, vector_bits=256 - vector_bits)  # the other path
    torch.testing.assert_close(got, other(batch, filled_cache(config)), atol=2e-3, rtol=1e-4)


def test_yield_points_between_layers_leave_the_result_unchanged(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> None:
    config = smollm2[0]
    stacked = block_model(smollm2, stack=True)
    batch = decode_batch(2)
    boundaries = []
    with_yields = stacked(batch, filled_cache(config), lambda: boundaries.append(1))
    assert len(boundaries) == config.num_layers  # one C call per layer, the yield point after each
    assert torch.equal(with_yields, stacked(batch, filled_cache(config)))


@pytest.mark.skipif(
    cpu_multiplies_bfloat16(), reason="this CPU multiplies bfloat16: bfloat16 linears take the pair layout"
)
@pytest.mark.parametrize("rows", [3, BLOCK_STACK_MAX_ROWS + 1])  # through the stack, op by op
def test_bfloat16_weights_on_themselves_compute_what_the_files_blocks_do(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without quantized blocks (a Hugging Face directory), a bfloat16 model's linears multiply on
    their own bfloat16 weights. Those hold the file's blocks' values rounded to bfloat16, which is
    what the kernel multiplies on the blocks, so every logit and cache entry is the same."""
    config, weights, _ = smollm2
    counting = CountingRuns(monkeypatch)
    own = block_model((config, weights, {}), stack=True, dtype=torch.bfloat16)
    assert {lin.blocks.type for lin in own.linears() if lin.blocks is not None} == {BF16}
    assert own.block_linears == 4 * config.num_layers + 1
    files = block_model(smollm2, stack=True, dtype=torch.bfloat16)
    own_cache, files_cache = filled_cache(config, torch.bfloat16), filled_cache(config, torch.bfloat16)
    batch = decode_batch(rows)
    assert torch.equal(own(batch, own_cache), files(batch, files_cache))
    assert counting.runs == (2 if rows <= BLOCK_STACK_MAX_ROWS else 0)
    for (k_a, v_a), (k_b, v_b) in zip(own_cache, files_cache, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


@pytest.mark.parametrize("rows", [3, BLOCK_STACK_MAX_ROWS + 1])
def test_float32_on_a_checkpoints_bfloat16_weights(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32 serving of a bfloat16 checkpoint: decode steps multiply the file's BF16 tensors
    (half the bytes of the float32 copies), the stack bit for bit the per-op path, and both the
    float32 product of the same weights (oneDNN, --no-block-linear) to float32 rounding."""
    config, weights, file_blocks = smollm2
    stored = {name: w.bfloat16() for name, w in weights.items()}  # as a bfloat16 directory holds them
    widened = {name: w.float() for name, w in stored.items()}  # what load_model gives of it
    blocks = {name: BlockWeight.dense(stored[name]) for name in file_blocks}
    counting = CountingRuns(monkeypatch)
    stacked = block_model((config, widened, blocks), stack=True)
    assert {lin.blocks.type for lin in stacked.linears() if lin.blocks is not None} == {BF16}
    per_op = block_model((config, widened, blocks), stack=False)
    copies = block_model((config, widened, blocks), stack=False, blocks=False)
    caches = [filled_cache(config) for _ in range(3)]
    batch = decode_batch(rows)
    got = stacked(batch, caches[0])
    assert counting.runs == (1 if rows <= BLOCK_STACK_MAX_ROWS else 0)
    assert torch.equal(got, per_op(batch, caches[1]))
    # 30 layers' sums in other orders, on random caches: logits came out up to 4e-3 apart.
    torch.testing.assert_close(got, copies(batch, caches[2]), atol=1e-2, rtol=1e-4)


def test_a_model_without_blocks_decodes_op_by_op(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = CountingRuns(monkeypatch)
    dense = block_model(smollm2, stack=True, blocks=False)  # --no-block-linear
    assert dense.block_linears == 0
    logits = dense(decode_batch(1), filled_cache(smollm2[0]))
    assert counting.runs == 0 and logits.shape == (1, smollm2[0].vocab_size)


def test_bind_names_the_blocks_it_cannot_take(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> None:
    config = smollm2[0]
    model = block_model(smollm2, stack=True)
    cache = filled_cache(config)
    attention = model.attention
    assert isinstance(attention, CpuPagedAttention) and attention.decode_stack is not None
    stack_layers = model.stack_layers(cache, blocks=True)
    assert stack_layers is not None
    bound = attention.decode_stack.bind(stack_layers, config.rms_norm_eps)
    assert bound.max_rows == BLOCK_STACK_MAX_ROWS and bound.dtype == torch.float32
    swapped = replace(stack_layers[1], block_weights=stack_layers[1].block_weights[::-1])
    with pytest.raises(ValueError, match=r"layers\[1\]\.block_weights \(qkv_weight\)"):
        attention.decode_stack.bind([stack_layers[0], swapped], config.rms_norm_eps)
    short = replace(stack_layers[1], block_weights=stack_layers[1].block_weights[:3])
    with pytest.raises(ValueError, match=r"layers\[1\]\.block_weights"):
        attention.decode_stack.bind([stack_layers[0], short], config.rms_norm_eps)
    bfloat16 = replace(stack_layers[0], o_weight=stack_layers[0].o_weight.bfloat16())
    with pytest.raises(ValueError, match=r"layers\[0\]\.o_weight"):
        attention.decode_stack.bind([bfloat16], config.rms_norm_eps)

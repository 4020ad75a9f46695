"""The decode stack on GGUF blocks (kernels/cpu_stack.py, blocks=True) against the per-op forward
it replaces, on SmolLM2-135M's own Q4_1/Q8_0 file: the same bits, the same KV cache. In float32,
and in bfloat16 where the CPU cannot multiply bfloat16 (there bfloat16 models take the blocks)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from bench.requantize_gguf import requantize
from gpu_worker import startup
from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.config import WorkerConfig
from gpu_worker.kv_cache import KVCache, allocate_kv_cache
from gpu_worker.linear import (
    BLOCK_MAX_ROWS,
    SMALL_STEP_ROWS,
    Linear,
    block_kernel,
    cpu_multiplies_bfloat16,
    packed_linear_available,
    small_steps_take_blocks,
)
from gpu_worker.loader import load_block_weights, load_model
from gpu_worker.model import LlamaModel, blocks_only_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.stack_binding import stack_layers
from gpu_worker.startup import make_attention
from kernels.block_weights import BF16, Q8_0, BlockRows, BlockWeight
from kernels.cpu_block_linear import BlockLinear
from kernels.cpu_stack import BLOCK_STACK_MAX_ROWS
from kernels.kv_int8 import Int8Cache
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
    kv_int8: bool = False,
) -> LlamaModel:
    config, weights, block_weights = smollm2
    model = LlamaModel(config, dtype, CPU)
    model.load_weights(weights, block_weights if blocks else None)
    attention = make_attention("cpu", config, dtype, CPU, BLOCK_SIZE, vector_bits, kv_int8=kv_int8)
    assert isinstance(attention, CpuPagedAttention)
    assert attention.decode_stack is not None and attention.decode_stack.blocks
    assert attention.decode_stack.dtype == dtype
    if not stack:
        attention.decode_stack = None
    model.use_attention(attention)
    return model


def filled_cache(config: ModelConfig, dtype: torch.dtype = torch.float32, kv_int8: bool = False) -> KVCache:
    cache = allocate_kv_cache(config, SEQS * BLOCKS_PER_SEQ, BLOCK_SIZE, dtype, CPU, kv_int8)
    gen = torch.Generator().manual_seed(0)
    if kv_int8:
        for layer in cache:
            for part in layer:
                assert isinstance(part, Int8Cache)
                part.values.copy_(
                    torch.randint(-127, 128, part.values.shape, generator=gen, dtype=torch.int8)
                )
                part.scales.copy_(torch.rand(part.scales.shape, generator=gen) * 0.05)
        return cache
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


@pytest.mark.parametrize("rows", [1, 7])
def test_on_an_int8_cache_the_stack_computes_the_per_op_forward_bit_for_bit(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--kv-cache-dtype int8` in float32 on the blocks: the stack's build writes and reads the int8
    cache as the per-op path does."""
    config = smollm2[0]
    counting = CountingRuns(monkeypatch)
    stacked = block_model(smollm2, stack=True, kv_int8=True)
    per_op = block_model(smollm2, stack=False, kv_int8=True)
    stacked_cache, per_op_cache = filled_cache(config, kv_int8=True), filled_cache(config, kv_int8=True)
    batch = decode_batch(rows)
    got = stacked(batch, stacked_cache)
    assert counting.runs == 1
    assert torch.equal(got, per_op(batch, per_op_cache))
    for pair_a, pair_b in zip(stacked_cache, per_op_cache, strict=True):
        for a, b in zip(pair_a, pair_b, strict=True):
            assert isinstance(a, Int8Cache) and isinstance(b, Int8Cache)
            assert torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)


@pytest.mark.skipif(
    not small_steps_take_blocks(torch.bfloat16, CPU),
    reason="small bfloat16 steps take the blocks on CPUs with AVX-512 BF16 and no AMX",
)
def test_small_bfloat16_steps_take_the_block_stack_and_the_others_the_pairs(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the CPU multiplies bfloat16 with AVX-512 BF16, a bfloat16 model keeps its linears'
    blocks beside the pair layouts: decode steps of up to SMALL_STEP_ROWS sequences run on the block stack
    (the blocks' dot products), larger ones on the pair-layout stack, each bit for bit the per-op
    path, whose linears choose the same kernels by the step's rows."""
    config, weights, block_weights = smollm2

    def loaded(stacks: bool) -> LlamaModel:
        model = LlamaModel(config, torch.bfloat16, CPU)
        model.load_weights(weights, block_weights)
        attention = make_attention("cpu", config, torch.bfloat16, CPU, BLOCK_SIZE)
        assert isinstance(attention, CpuPagedAttention)
        assert attention.small_decode_stack is not None and attention.small_decode_stack.blocks
        assert attention.decode_stack is not None and not attention.decode_stack.blocks
        if not stacks:
            attention.decode_stack = attention.small_decode_stack = None
        model.use_attention(attention)
        return model

    stacked, per_op = loaded(stacks=True), loaded(stacks=False)
    assert all(linear.blocks is not None for linear in stacked.linears())
    counting = CountingRuns(monkeypatch)
    for rows in (1, SMALL_STEP_ROWS, SMALL_STEP_ROWS + 1, 8):
        stacked_cache, per_op_cache = (
            filled_cache(config, torch.bfloat16),
            filled_cache(config, torch.bfloat16),
        )
        batch = decode_batch(rows)
        got, want = stacked(batch, stacked_cache), per_op(batch, per_op_cache)
        assert torch.equal(got, want), rows
        for (k_a, v_a), (k_b, v_b) in zip(stacked_cache, per_op_cache, strict=True):
            assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    assert counting.on_blocks == [True, True, False, False]


def mixed_parts(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """SmolLM2 with every layer's v_proj and up_proj requantized to Q8_0 beside Q4_1 q/k and gate,
    as a K-quant file gives attn_v more bits than attn_q and attn_k: fused linears whose parts'
    blocks differ in type (BlockRows)."""
    config, weights, blocks = smollm2
    weights, blocks = dict(weights), dict(blocks)
    for i in range(config.num_layers):
        for name in (f"model.layers.{i}.self_attn.v_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"):
            stored = gguf.quants.quantize(weights[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
            blocks[name] = BlockWeight(
                Q8_0, torch.from_numpy(stored.reshape(weights[name].shape[0], -1)), weights[name].shape[1]
            )
            weights[name] = blocks[name].dequantize()
    return config, weights, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, BLOCK_STACK_MAX_ROWS])
def test_fused_linears_of_mixed_block_types_stack_bit_for_bit(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    rows: int,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """q/k in Q4_1 with v in Q8_0, gate in Q4_1 with up in Q8_0: every linear still takes the blocks,
    the stack calls each part into its columns, and gives the per-op forward's bits and KV cache."""
    mixed = mixed_parts(smollm2)
    config = mixed[0]
    counting = CountingRuns(monkeypatch)
    stacked = block_model(mixed, stack=True, dtype=dtype)
    assert stacked.block_linears == 4 * config.num_layers + 1
    layer = stacked.layers[0]
    assert isinstance(layer.qkv.blocks, BlockRows) and layer.qkv.blocks.type_name == "Q4_1+Q8_0"
    assert isinstance(layer.gate_up.blocks, BlockRows) and len(layer.gate_up.blocks.parts) == 2
    per_op = block_model(mixed, stack=False, dtype=dtype)
    caches = filled_cache(config, dtype), filled_cache(config, dtype)
    batch = decode_batch(rows)
    got = stacked(batch, caches[0])
    assert counting.runs == 1
    assert torch.equal(got, per_op(batch, caches[1]))
    for (k_a, v_a), (k_b, v_b) in zip(*caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)
    if dtype == torch.float32:  # the parts hold the weights' values: the dense forward agrees
        dense = block_model(mixed, stack=False, blocks=False)
        want = dense(batch, filled_cache(config))
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)  # summation order, 30 layers


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
    layers = stack_layers(model, cache, blocks=True)
    assert layers is not None
    bound = attention.decode_stack.bind(layers, config.rms_norm_eps)
    assert bound.max_rows == BLOCK_STACK_MAX_ROWS and bound.dtype == torch.float32
    swapped = replace(layers[1], block_weights=layers[1].block_weights[::-1])
    with pytest.raises(ValueError, match=r"layers\[1\]\.block_weights \(qkv_weight\)"):
        attention.decode_stack.bind([layers[0], swapped], config.rms_norm_eps)
    short = replace(layers[1], block_weights=layers[1].block_weights[:3])
    with pytest.raises(ValueError, match=r"layers\[1\]\.block_weights"):
        attention.decode_stack.bind([layers[0], short], config.rms_norm_eps)
    bfloat16 = replace(layers[0], o_weight=layers[0].o_weight.bfloat16())
    with pytest.raises(ValueError, match=r"layers\[0\]\.o_weight"):
        attention.decode_stack.bind([bfloat16], config.rms_norm_eps)


def shapes_only(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """The model as the worker loads it with --dense-weights drop: the weights that can multiply
    on blocks alone unread (shapes on the "meta" device), as load_model's `shape_only` gives them."""
    config, weights, blocks = smollm2
    names = blocks_only_weights(config, blocks)
    unread = {
        name: torch.empty(w.shape, device="meta") if name in names else w for name, w in weights.items()
    }
    return config, unread, blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stack", [True, False])  # through the stack, op by op
def test_weights_held_as_blocks_alone_decode_as_with_their_dense_copies(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    stack: bool,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode-sized steps take the blocks with or without dense copies: the same bits, the same
    KV cache. The tied LM head keeps its dense copy, the embedding's."""
    config = smollm2[0]
    counting = CountingRuns(monkeypatch)
    alone = block_model(shapes_only(smollm2), stack=stack, dtype=dtype)
    assert [lin.blocks_only for lin in alone.linears()] == [False] + [True] * (4 * config.num_layers)
    assert all(layer.qkv_weight.is_meta and layer.down_weight.is_meta for layer in alone.layers)
    assert not alone.embed_tokens.is_meta and alone.lm_head is alone.embed_tokens
    with_copies = block_model(smollm2, stack=stack, dtype=dtype)
    caches = filled_cache(config, dtype), filled_cache(config, dtype)
    batch = decode_batch(3)
    assert torch.equal(alone(batch, caches[0]), with_copies(batch, caches[1]))
    assert counting.runs == (2 if stack else 0)
    for (k_a, v_a), (k_b, v_b) in zip(*caches, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


def prefill_batch(tokens: int) -> Any:
    """One prompt of `tokens` tokens from the start, a step of more rows than BLOCK_MAX_ROWS."""
    blocks = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    ids = [(7 * i) % 4000 + 3 for i in range(tokens)]
    return build_forward_batch([ScheduledChunk(ids, 0, list(range(blocks)), True)], BLOCK_SIZE, CPU)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_held_as_blocks_alone_prefill_on_the_blocks(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 300-token prefill step: without dense copies every linear but the tied head multiplies
    on its blocks. In bfloat16 the dense model takes them too (the same bits); in float32 it takes
    oneDNN on the float32 copies, the same products summed in another order."""
    config = smollm2[0]
    tokens = BLOCK_MAX_ROWS + 44
    alone = block_model(shapes_only(smollm2), stack=True, dtype=dtype)
    with_copies = block_model(smollm2, stack=True, dtype=dtype)
    multiplied: list[int] = []
    real_call = BlockLinear.__call__

    def counting_call(self: BlockLinear, x: torch.Tensor, *args: Any) -> torch.Tensor:
        multiplied.append(x.shape[0])
        return real_call(self, x, *args)

    monkeypatch.setattr(BlockLinear, "__call__", counting_call)
    batch = prefill_batch(tokens)
    cache_size = (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
    caches = [allocate_kv_cache(config, cache_size, BLOCK_SIZE, dtype, CPU) for _ in range(2)]
    got = alone(batch, caches[0])
    assert multiplied.count(tokens) == 4 * config.num_layers
    want = with_copies(batch, caches[1])
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        # 30 layers' sums in other orders: the logits (up to 28) came out up to 5e-5 apart.
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_a_weight_held_as_a_shape_needs_blocks(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
) -> None:
    config, unread, _ = shapes_only(smollm2)
    model = LlamaModel(config, torch.float32, CPU)
    with pytest.raises(ValueError, match="held as a shape only needs blocks"):
        model.load_weights(unread, None)
    part = dict(smollm2[1])
    part["model.layers.0.self_attn.k_proj.weight"] = torch.empty(
        part["model.layers.0.self_attn.k_proj.weight"].shape, device="meta"
    )
    with pytest.raises(ValueError, match="read only in part"):
        LlamaModel(config, torch.float32, CPU).load_weights(part, smollm2[2])
    part = dict(smollm2[1])
    part["model.embed_tokens.weight"] = torch.empty(part["model.embed_tokens.weight"].shape, device="meta")
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight must be read"):
        LlamaModel(config, torch.float32, CPU).load_weights(part, smollm2[2])


def test_dense_weights_setting_chooses_the_weights_held_as_blocks_alone(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--dense-weights: keep holds every dense copy; drop none where blocks can serve; auto drops
    them in bfloat16 where the blocks take every step (a CPU that cannot multiply bfloat16; where
    it can, the pair-layout and oneDNN kernels multiply the dense copies), and in float32 only when
    the float32 and packed copies would take more than a quarter of the free memory."""
    config, _, blocks = smollm2
    every = blocks_only_weights(config, blocks)
    assert len(every) == 7 * config.num_layers  # q, k, v, o, gate, up, down; not the tied head
    choose = startup.choose_blocks_only
    assert choose("keep", torch.float32, config, blocks, CPU) == set()
    assert choose("drop", torch.float32, config, blocks, CPU) == every
    assert choose("auto", torch.bfloat16, config, blocks, CPU) == (
        set() if cpu_multiplies_bfloat16() else every
    )
    assert choose("drop", torch.bfloat16, config, blocks, CPU) == every
    assert choose("auto", torch.float32, config, {}, CPU) == set()
    copies = 2 if packed_linear_available(torch.float32, CPU) else 1
    dense_bytes = copies * 4 * sum(weight.numel() for name, weight in smollm2[1].items() if name in every)
    monkeypatch.setattr(startup, "free_memory_bytes", lambda device: 4 * dense_bytes)
    assert choose("auto", torch.float32, config, blocks, CPU) == set()
    monkeypatch.setattr(startup, "free_memory_bytes", lambda device: 4 * dense_bytes - 1)
    assert choose("auto", torch.float32, config, blocks, CPU) == every


def worker_loaded(
    path: Path, config: ModelConfig, kernel: BlockLinear | None, dense_weights: str
) -> LlamaModel:
    """The model as the worker loads it in float32 (load_weights), the block build having given
    `kernel`."""
    settings = WorkerConfig(model=str(path), scheduler_address="ipc:///unused", dense_weights=dense_weights)
    built: Future[BlockLinear | None] = Future()
    built.set_result(kernel)
    return startup.load_weights(settings, config, torch.float32, CPU, built)


def dequantized_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaModel:
    """The model on load_model's float32 tensors, dequantized by the gguf package."""
    model = LlamaModel(config, torch.float32, CPU)
    model.load_weights(dict(weights))
    return model


def holds_values(linear: Linear, weight: torch.Tensor) -> bool:
    """Whether the copy a float32 linear multiplies on past the block kernel's rows (oneDNN's,
    packed from the dense weight the worker then released) holds `weight`'s values bit for bit:
    row i of the identity picks column i."""
    eye = torch.eye(weight.shape[1])  # more rows than the block kernel takes
    return torch.equal(linear(eye), weight.T)


@pytest.mark.parametrize("dense_weights", ["keep", "drop"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no-kernel"])
def test_the_worker_loads_dense_copies_when_the_block_build_gives_no_kernel(
    smollm2: tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight]],
    kernel: bool,
    dense_weights: str,
) -> None:
    """The worker reads the file's blocks while the block linear builds (gpu_worker/startup.py,
    load_weights). With --dense-weights drop it skips the dense copies; if the build then gives
    no kernel, every linear must still get a dense copy, read afresh. The copies it multiplies on
    (packed by oneDNN from the dense ones, which it then releases) hold the file's dequantized
    values bit for bit, whether the kernel widened them or numpy did."""
    if kernel and block_kernel() is None:
        pytest.skip("no block linear kernel on this CPU")
    model = worker_loaded(find_default_model(), smollm2[0], block_kernel() if kernel else None, dense_weights)
    linears = model.linears()
    if kernel and dense_weights == "drop":
        assert model.block_linears == len(linears)
        # qkv, o, gate_up and down of each layer; the tied head keeps its dense embedding
        assert sum(lin.weight.is_meta for lin in linears) == 4 * smollm2[0].num_layers
        return
    assert model.block_linears == (len(linears) if kernel else 0)
    assert not any(lin.blocks_only for lin in linears)
    # Each layer's dense weights were released once packed; the tied head's is the embedding's.
    assert sum(lin.weight.is_meta for lin in linears) == 4 * smollm2[0].num_layers
    dense = dequantized_model(smollm2[0], smollm2[1])
    assert len(linears) == len(dense.linears())
    assert all(holds_values(a, b.weight) for a, b in zip(linears, dense.linears(), strict=True))
    assert torch.equal(model.embed_tokens, dense.embed_tokens)


def ternary_and_fp4(kind: str, layer: int, layers: int, k: int) -> str | None:
    """Layers 0-3 of SmolLM2 in MXFP4, NVFP4 and (rows of 1536) TQ1_0 and TQ2_0; the rest as
    stored."""
    if layer > 3:
        return None
    if k % 256 == 0 and layer >= 2:
        return "TQ1_0" if layer == 2 else "TQ2_0"
    return "MXFP4" if layer % 2 == 0 else "NVFP4"


def test_the_worker_widens_ternary_and_fp4_weights_to_their_values(tmp_path: Path) -> None:
    """A file with TQ1_0, TQ2_0, MXFP4 and NVFP4 layers: with the kernel every linear takes its
    blocks, and the float32 copies the worker widens from them are the gguf package's values, bit
    for bit (load_model dequantizes them with numpy)."""
    kernel = block_kernel()
    if kernel is None:
        pytest.skip("no block linear kernel on this CPU")
    path = tmp_path / "smollm2-tq-fp4.gguf"
    counts = requantize(find_default_model(), path, "", choose=ternary_and_fp4)
    assert counts == {"MXFP4": 13, "NVFP4": 13, "TQ1_0": 1, "TQ2_0": 1}  # 7 matrices a layer
    config, weights = load_model(path)
    blocks = load_block_weights(path, config)
    assert {blocks[f"model.layers.{layer}.mlp.down_proj.weight"].type_name for layer in range(4)} == {
        "MXFP4",
        "NVFP4",
        "TQ1_0",
        "TQ2_0",
    }
    model = worker_loaded(path, config, kernel, "keep")
    assert model.block_linears == len(model.linears())
    dense = dequantized_model(config, weights)
    assert all(holds_values(a, b.weight) for a, b in zip(model.linears(), dense.linears(), strict=True))

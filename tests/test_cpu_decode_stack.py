"""The one-call CPU decode stack against the per-op fused forward it replaces: the same bits."""

from __future__ import annotations

import ctypes
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker.attention import CpuPagedAttention
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.kv_cache import KVCache, allocate_kv_cache
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.startup import make_attention
from kernels import cpu_pair_linear
from kernels.cpu_stack import StackLayer, load_cpu_decode_stack
from kernels.kv_int8 import Int8Cache
from tests.cpu_features import has_avx512_bf16
from tests.worker_steps import CountingRuns, save_tiny_llama

transformers = pytest.importorskip("transformers")

# Only a CPU without AVX-512 BF16 cannot run the stack (its linears need it).
pytestmark = pytest.mark.skipif(not has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")

BLOCK_SIZE = 16
CPU = torch.device("cpu")

# head_dim 16 (the first two) builds the decode attention's scalar path; head_dim 32 with blocks of
# 16 its AVX-512 path, as SmolLM2's 64 does.
SHAPES = {"llama": {}, "qkv-bias": {"attention_bias": True}, "head-dim-32": {"hidden_size": 128}}


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Any]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-stack"), **SHAPES[request.param])


def bfloat16_model(
    tiny: tuple[ModelConfig, Any], stack: bool, kv_int8: bool = False, release: bool = False
) -> tuple[LlamaModel, KVCache]:
    """With `release`, the dense weights that only the pair layouts were packed from are released,
    as the worker does once loaded: the stack then binds on their shapes alone."""
    config, weights = tiny
    model = LlamaModel(config, torch.bfloat16, CPU)
    model.load_weights(weights)
    if release:
        assert model.release_unread_weights() > 0
    attention = make_attention("cpu", config, torch.bfloat16, CPU, BLOCK_SIZE, kv_int8=kv_int8)
    assert isinstance(attention, CpuPagedAttention) and attention.decode_stack is not None
    assert attention.decode_stack.kv_int8 == kv_int8
    if not stack:
        attention.decode_stack = None
    model.use_attention(attention)
    return model, allocate_kv_cache(config, 80, BLOCK_SIZE, torch.bfloat16, CPU, kv_int8)


@pytest.mark.parametrize("rows", [1, 2, 19])  # 19: more than one tile or block of rows
@pytest.mark.parametrize("with_yield_points", [False, True])
def test_the_stack_computes_the_per_op_forward_bit_for_bit(
    tiny: tuple[ModelConfig, Any], rows: int, with_yield_points: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = CountingRuns(monkeypatch)
    stacked, stacked_cache = bfloat16_model(tiny, stack=True, release=True)
    per_op, per_op_cache = bfloat16_model(tiny, stack=False)
    # Prompts of 7 and 14 tokens: their decodes cross the block boundary at 16 within 12 steps.
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(rows)]
    prompts = [[(7 * i + 3 * s) % 250 + 3 for i in range(7 if s % 2 == 0 else 14)] for s in range(rows)]
    prefill = [ScheduledChunk(p, 0, tables[s], True) for s, p in enumerate(prompts)]
    batch = build_forward_batch(prefill, BLOCK_SIZE, CPU)
    first = stacked(batch, stacked_cache)
    assert torch.equal(first, per_op(batch, per_op_cache))
    assert counting.runs == 0  # prefill chunks take the per-op path
    tokens = first.argmax(-1).tolist()
    lengths = [len(p) for p in prompts]
    boundaries: list[int] = []
    for _ in range(12):
        decode = [ScheduledChunk([tokens[s]], lengths[s], tables[s], True) for s in range(rows)]
        batch = build_forward_batch(decode, BLOCK_SIZE, CPU)
        yield_point = (lambda: boundaries.append(1)) if with_yield_points else None
        logits = stacked(batch, stacked_cache, yield_point)
        assert torch.equal(logits, per_op(batch, per_op_cache))
        tokens = logits.argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    stacked_steps = 12 if rows <= cpu_pair_linear.MAX_ROWS else 0
    assert counting.runs == stacked_steps
    assert len(boundaries) == (12 * tiny[0].num_layers if with_yield_points else 0)
    for (k_a, v_a), (k_b, v_b) in zip(stacked_cache, per_op_cache, strict=True):
        assert torch.equal(k_a, k_b) and torch.equal(v_a, v_b)


@pytest.mark.parametrize("rows", [1, 19])
def test_on_an_int8_cache_the_stack_computes_the_per_op_forward_bit_for_bit(
    tiny: tuple[ModelConfig, Any], rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--kv-cache-dtype int8`: the stack's build quantizes the step's rows and reads the int8 cache
    as the per-op path's C write and decode kernel do; caches, scales and logits alike."""
    counting = CountingRuns(monkeypatch)
    stacked, stacked_cache = bfloat16_model(tiny, stack=True, kv_int8=True, release=True)
    per_op, per_op_cache = bfloat16_model(tiny, stack=False, kv_int8=True)
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(rows)]
    prompts = [[(5 * i + 3 * s) % 250 + 3 for i in range(9 if s % 2 == 0 else 15)] for s in range(rows)]
    batch = build_forward_batch(
        [ScheduledChunk(p, 0, tables[s], True) for s, p in enumerate(prompts)], BLOCK_SIZE, CPU
    )
    first = stacked(batch, stacked_cache)
    assert torch.equal(first, per_op(batch, per_op_cache))
    tokens, lengths = first.argmax(-1).tolist(), [len(p) for p in prompts]
    for _ in range(10):
        decode = [ScheduledChunk([tokens[s]], lengths[s], tables[s], True) for s in range(rows)]
        batch = build_forward_batch(decode, BLOCK_SIZE, CPU)
        logits = stacked(batch, stacked_cache)
        assert torch.equal(logits, per_op(batch, per_op_cache))
        tokens, lengths = logits.argmax(-1).tolist(), [n + 1 for n in lengths]
    assert counting.runs == 10
    for pair_a, pair_b in zip(stacked_cache, per_op_cache, strict=True):
        for a, b in zip(pair_a, pair_b, strict=True):
            assert isinstance(a, Int8Cache) and isinstance(b, Int8Cache)
            assert torch.equal(a.values, b.values) and torch.equal(a.scales, b.scales)
            assert int(a.values.abs().max()) == 127  # written: each row's largest is 127


def test_a_step_run_between_layers_of_a_stacked_step_leaves_both_as_they_would_be_alone(
    tiny: tuple[ModelConfig, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An urgent step runs at the block boundaries of the step in progress, on the same thread. A
    one-token prompt is a decode row, so it takes the stack too, inside the other's run: the two
    share the thread's scratch buffers, which hold nothing between layers."""
    counting = CountingRuns(monkeypatch)
    nested, nested_cache = bfloat16_model(tiny, stack=True)
    alone, alone_cache = bfloat16_model(tiny, stack=True)
    prompt = ScheduledChunk([5, 9, 14, 3, 77, 21, 8], 0, [0, 1], True)
    for model, cache in ((nested, nested_cache), (alone, alone_cache)):
        model(build_forward_batch([prompt], BLOCK_SIZE, CPU), cache)
    outer = build_forward_batch([ScheduledChunk([40], 7, [0, 1], True)], BLOCK_SIZE, CPU)
    inner = build_forward_batch([ScheduledChunk([42], 0, [5], True)], BLOCK_SIZE, CPU)  # a one-token prompt
    inner_logits: list[torch.Tensor] = []

    def run_inner_once() -> None:
        if not inner_logits:
            inner_logits.append(nested(inner, nested_cache))

    outer_logits = nested(outer, nested_cache, run_inner_once)
    assert counting.runs == 2 and len(inner_logits) == 1  # both took the stack
    assert torch.equal(outer_logits, alone(outer, alone_cache))
    assert torch.equal(inner_logits[0], alone(inner, alone_cache))


class FlaggedBoundary:
    """A yield point that carries `pending`: the stack runs every layer in one call and stops only
    where the flag is set. This one keeps it set through its first call, so the stack stops again
    after the next layer, then clears it."""

    def __init__(self) -> None:
        self.pending = ctypes.c_int32(1)  # set before the step starts: stop after the first layer
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > 1:
            self.pending.value = 0


def test_the_stack_stops_only_at_boundaries_where_its_yield_point_is_pending(
    tiny: tuple[ModelConfig, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    stacked, stacked_cache = bfloat16_model(tiny, stack=True)
    per_op, per_op_cache = bfloat16_model(tiny, stack=False)
    prompt = ScheduledChunk([5, 9, 14, 3, 77, 21, 8], 0, [0, 1], True)
    for model, cache in ((stacked, stacked_cache), (per_op, per_op_cache)):
        model(build_forward_batch([prompt], BLOCK_SIZE, CPU), cache)
    calls: list[int] = []
    function = stacked.attention.decode_stack.function  # type: ignore[union-attr]

    def counted(*args: Any) -> int:
        layers_run = int(function(*args))
        calls.append(layers_run)
        return layers_run

    monkeypatch.setattr(stacked.attention.decode_stack, "function", counted)  # type: ignore[union-attr]
    boundary = FlaggedBoundary()
    decode = build_forward_batch([ScheduledChunk([40], 7, [0, 1], True)], BLOCK_SIZE, CPU)
    logits = stacked(decode, stacked_cache, boundary)
    num_layers = tiny[0].num_layers
    assert calls == [1, 1, num_layers - 2]  # stopped after layers 1 and 2, then ran the rest at once
    assert boundary.calls == 2
    assert torch.equal(logits, per_op(decode, per_op_cache))


def test_steps_past_the_stacks_rows_take_the_per_op_path(
    tiny: tuple[ModelConfig, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = CountingRuns(monkeypatch)
    model, cache = bfloat16_model(tiny, stack=True)
    for rows, runs in ((cpu_pair_linear.MAX_ROWS, 1), (cpu_pair_linear.MAX_ROWS + 1, 1)):
        decode = [ScheduledChunk([5], 3, [s], True) for s in range(rows)]
        model(build_forward_batch(decode, BLOCK_SIZE, CPU), cache)
        assert counting.runs == runs, rows


def layers_of(model: LlamaModel, cache: KVCache) -> list[StackLayer]:
    model_layers = list(model.layers)
    norms = [layer.input_layernorm.weight for layer in model_layers[1:]] + [model.norm.weight]
    return [
        StackLayer(
            layer.qkv_weight.detach(),
            None if layer.qkv_bias is None else layer.qkv_bias.detach(),
            layer.o_weight.detach(),
            layer.post_attention_layernorm.weight.detach(),
            layer.gate_up_weight.detach(),
            layer.down_weight.detach(),
            norm.detach(),
            k,
            v,
            tuple(
                cpu_pair_linear.pack(w.detach())
                for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
            ),
        )
        for layer, norm, (k, v) in zip(model_layers, norms, cache, strict=True)
    ]


def test_bind_and_run_name_what_they_cannot_take(tiny: tuple[ModelConfig, Any]) -> None:
    config = tiny[0]
    model, cache = bfloat16_model(tiny, stack=True)
    stack = load_cpu_decode_stack(config.head_dim, config.num_heads // config.num_kv_heads, BLOCK_SIZE)
    layers = layers_of(model, cache)
    wrong = StackLayer(
        **{
            **{f: getattr(layers[1], f) for f in StackLayer.__dataclass_fields__},
            "o_weight": layers[1].o_weight.float(),
        }
    )
    with pytest.raises(ValueError, match="at least one decoder layer"):
        stack.bind([], config.rms_norm_eps)
    with pytest.raises(ValueError, match=r"layers\[1\]\.o_weight"):
        stack.bind([layers[0], wrong, *layers[2:]], config.rms_norm_eps)
    misshapen = replace(layers[1], pair_weights=layers[1].pair_weights[::-1])
    with pytest.raises(ValueError, match=r"layers\[1\]\.pair_weights \(qkv_weight\)"):
        stack.bind([layers[0], misshapen, *layers[2:]], config.rms_norm_eps)
    with pytest.raises(ValueError, match=r"layers\[1\]\.pair_weights"):
        stack.bind(
            [layers[0], replace(layers[1], pair_weights=layers[1].pair_weights[:3]), *layers[2:]],
            config.rms_norm_eps,
        )
    bound = stack.bind(layers, config.rms_norm_eps)
    assert bound.max_rows == cpu_pair_linear.MAX_ROWS
    half = config.head_dim // 2
    x = torch.zeros(1, config.hidden_size, dtype=torch.bfloat16)
    args = {
        "x": x,
        "residual": x.clone(),
        "cos": torch.ones(1, half),
        "sin": torch.zeros(1, half),
        "slots": torch.tensor([3]),
        "block_tables": torch.zeros(1, 1, dtype=torch.int32),
        "context_lens": torch.tensor([4], dtype=torch.int32),
    }
    num_slots = cache[0][0].shape[0] * BLOCK_SIZE
    with pytest.raises(ValueError, match="slots"):
        bound.run(**{**args, "slots": torch.tensor([num_slots])})
    with pytest.raises(ValueError, match=r"^residual: "):  # x of 3 rows, the residual of 1
        bound.run(**{**args, "x": torch.zeros(3, config.hidden_size, dtype=torch.bfloat16)})
    too_many = torch.zeros(cpu_pair_linear.MAX_ROWS + 1, config.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^x: expected 1\.\.{cpu_pair_linear.MAX_ROWS} rows"):
        bound.run(**{**args, "x": too_many, "residual": too_many.clone()})
    with pytest.raises(ValueError, match="cos"):
        bound.run(**{**args, "cos": torch.ones(1, half, dtype=torch.float64)})
    with pytest.raises(ValueError, match="context_lens"):
        bound.run(**{**args, "context_lens": torch.tensor([4])})
    out = bound.run(**args)
    assert out.shape == x.shape and bool(torch.isfinite(out.float()).all())


def test_changing_an_included_source_rebuilds_the_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_stack.c includes the other kernels' sources, so the cache key must cover them."""
    from kernels import cpu_build

    sources = tmp_path / "cpu"
    shutil.copytree(cpu_build.SOURCES, sources)
    monkeypatch.setenv("DUOSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    defines = {"HEAD_DIM": 16, "GROUP": 2, "BLOCK": 8, "ELEM_BF16": 1}
    before = cpu_build.build("decode_stack.c", defines, sources)
    assert cpu_build.build("decode_stack.c", defines, sources) == before  # cached
    included = sources / "fused_ops.c"
    included.write_text(included.read_text() + "\n/* changed */\n")
    after = cpu_build.build("decode_stack.c", defines, sources)
    assert after != before and after.exists()


@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (128, 4)])  # SmolLM2's shape; Llama 3 8B's
def test_the_stack_builds_at_real_models_shapes(head_dim: int, group: int) -> None:
    """The model falls back to the per-op path when the stack does not build (KernelBuildError), so
    only building it here catches a source that compiles alone but not in the stack, which includes
    the others (the attention's AVX-512 path needs head_dim in 32s and blocks in 16s)."""
    stack = load_cpu_decode_stack(head_dim, group, 16)
    assert (stack.head_dim, stack.group, stack.block_size) == (head_dim, group, 16)


def test_a_model_whose_linears_have_no_pair_layout_weights_decodes_op_by_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs of 48 are not in the pair-layout kernel's 32s: its linears stay on oneDNN, and its
    decode steps take the per-op path (checked once, not at every step) with the same results."""
    counting = CountingRuns(monkeypatch)
    odd = save_tiny_llama(
        tmp_path, hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=96
    )
    stacked, stacked_cache = bfloat16_model(odd, stack=True)
    per_op, per_op_cache = bfloat16_model(odd, stack=False)
    assert stacked.layers[0].qkv.pair_weight is None  # type: ignore[union-attr]
    prompt = ScheduledChunk([5, 9, 14, 3, 77, 21, 8], 0, [0, 1], True)
    for model, cache in ((stacked, stacked_cache), (per_op, per_op_cache)):
        model(build_forward_batch([prompt], BLOCK_SIZE, CPU), cache)
    for position in (7, 8):
        decode = build_forward_batch(
            [ScheduledChunk([40 + position], position, [0, 1], True)], BLOCK_SIZE, CPU
        )
        assert torch.equal(stacked(decode, stacked_cache), per_op(decode, per_op_cache))
    assert counting.runs == 0
    assert stacked.stack_binding.unavailable

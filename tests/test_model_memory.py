"""What a loaded CPU model holds: the dense weights its packed linears never read are released
(LlamaModel.release_unread_weights; the worker's load releases them layer by layer), and every step
stays the same."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_worker import model as model_module
from gpu_worker import startup
from gpu_worker.batch import ScheduledChunk, build_forward_batch
from gpu_worker.config import WorkerConfig
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.linear import packed_linear_available
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from kernels.cpu_block_linear import BlockLinear
from tests.worker_steps import save_tiny_llama

pytest.importorskip("transformers")

CPU = torch.device("cpu")
BLOCK_SIZE = 16
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, Any]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-memory"), tie_word_embeddings=request.param)


def loaded(tiny: tuple[ModelConfig, Any], dtype: torch.dtype) -> LlamaModel:
    config, weights = tiny
    model = LlamaModel(config, dtype, CPU)
    model.load_weights(weights)
    model.use_attention(startup.make_attention("cpu", config, dtype, CPU, BLOCK_SIZE))
    return model


def steps(model: LlamaModel) -> list[torch.Tensor]:
    """Logits of a prefill of two prompts (one past a block), then of three decode steps."""
    config = model.config
    cache = allocate_kv_cache(config, 16, BLOCK_SIZE, model.dtype, CPU)
    prompts = [[(5 * i + 3) % 250 + 3 for i in range(21)], [(7 * i + 1) % 250 + 3 for i in range(6)]]
    tables = [[0, 1, 2], [3, 4]]
    batch = build_forward_batch(
        [ScheduledChunk(p, 0, tables[s], True) for s, p in enumerate(prompts)], BLOCK_SIZE, CPU
    )
    found = [model(batch, cache)]
    lengths = [len(p) for p in prompts]
    for _ in range(3):
        tokens = found[-1].argmax(-1).tolist()
        decode = [ScheduledChunk([tokens[s]], lengths[s], tables[s], True) for s in range(2)]
        found.append(model(build_forward_batch(decode, BLOCK_SIZE, CPU), cache))
        lengths = [n + 1 for n in lengths]
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_released_weights_leave_every_step_unchanged(
    tiny: tuple[ModelConfig, Any], dtype: torch.dtype
) -> None:
    if not packed_linear_available(dtype, CPU):
        pytest.skip(f"oneDNN's packed linear does not run in {dtype} on this CPU")
    config = tiny[0]
    model = loaded(tiny, dtype)
    before = steps(model)
    layers = model.decoder_layers()
    dense = sum(
        w.numel() * w.element_size()
        for layer in layers
        for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
    )
    head = 0 if config.tie_word_embeddings else model.lm_head.numel() * model.lm_head.element_size()
    assert model.release_unread_weights() == dense + head
    assert all(lin.weight.is_meta for lin in model.linears()[1:])
    # A tied head's weight is the embedding, which steps look rows up in: it stays.
    assert model.lm_head.is_meta != config.tie_word_embeddings
    assert not model.embed_tokens.is_meta
    assert model.release_unread_weights() == 0  # nothing left to release
    after = steps(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_consuming_load_releases_as_it_goes_and_steps_the_same(
    tiny: tuple[ModelConfig, Any], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_weights(consume=True), the worker's load: when a layer's linears are packed, the layers
    before it hold no dense weight and the state dict none of its or their tensors; it releases
    what release_unread_weights does, takes every tensor out of the state dict, and every step is
    the same bits."""
    if not packed_linear_available(dtype, CPU):
        pytest.skip(f"oneDNN's packed linear does not run in {dtype} on this CPU")
    config, weights = tiny
    reference = loaded(tiny, dtype)
    want = reference.release_unread_weights()
    assert want > 0

    model = LlamaModel(config, dtype, CPU)
    state = dict(weights)
    seen: list[int] = []
    prepare = model_module.DecoderLayer.prepare_linears

    def packing(layer: model_module.DecoderLayer, *args: Any, **kwargs: Any) -> None:
        index = next(i for i, each in enumerate(model.decoder_layers()) if each is layer)
        earlier = model.decoder_layers()[:index]
        assert all(
            w.is_meta
            for each in earlier
            for w in (each.qkv_weight, each.o_weight, each.gate_up_weight, each.down_weight)
        ), f"a layer before layer {index} still holds a dense weight"
        assert not [
            name for name in state if name.startswith(tuple(f"model.layers.{i}." for i in range(index + 1)))
        ]
        seen.append(index)
        prepare(layer, *args, **kwargs)

    monkeypatch.setattr(model_module.DecoderLayer, "prepare_linears", packing)
    assert model.load_weights(state, consume=True) == want
    monkeypatch.undo()
    assert seen == list(range(config.num_layers))
    assert state == {}
    assert all(lin.weight.is_meta for lin in model.linears()[1:])
    assert model.lm_head.is_meta != config.tie_word_embeddings
    model.use_attention(startup.make_attention("cpu", config, dtype, CPU, BLOCK_SIZE))
    assert all(torch.equal(a, b) for a, b in zip(steps(reference), steps(model), strict=True))


def test_a_load_that_does_not_consume_leaves_the_state_dict_and_the_weights(
    tiny: tuple[ModelConfig, Any],
) -> None:
    config, weights = tiny
    state = dict(weights)
    assert LlamaModel(config, torch.float32, CPU).load_weights(state) == 0
    assert state.keys() == weights.keys() and all(state[name] is weights[name] for name in weights)


def test_linears_that_multiply_on_their_weights_keep_them(
    tiny: tuple[ModelConfig, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without oneDNN's packed linear, F.linear multiplies on the weights themselves."""
    monkeypatch.setattr(model_module, "packed_linear_available", lambda dtype, device: False)
    model = loaded(tiny, torch.float32)
    assert not any(lin.packed for lin in model.linears())
    before = steps(model)
    assert model.release_unread_weights() == 0
    assert not any(lin.weight.is_meta for lin in model.linears())
    assert all(torch.equal(a, b) for a, b in zip(before, steps(model), strict=True))


def test_the_worker_releases_them_once_loaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """gpu_worker/startup.py's load_weights, as a worker runs it on a float32 directory."""
    config, _ = save_tiny_llama(tmp_path)
    settings = WorkerConfig(model=str(tmp_path), scheduler_address="ipc:///unused")
    no_blocks: Future[BlockLinear | None] = Future()
    no_blocks.set_result(None)
    with caplog.at_level("INFO", logger="gpu_worker.startup"):
        model = startup.load_weights(settings, config, torch.float32, CPU, no_blocks)
    assert all(lin.weight.is_meta for lin in model.linears())
    assert any("MB of dense weights released" in r.getMessage() for r in caplog.records)

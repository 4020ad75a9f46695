"""Model loading: GGUF metadata, HF directories (single and sharded), and errors that name the culprit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gpu_worker.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from gpu_worker.loader import fill_unread, load_config, load_model
from gpu_worker.model_config import ModelConfig, ModelLoadError, expected_shapes
from scheduler.model_files import find_default_model

TINY_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
}


def _write_hf_dir(folder: Path, drop: str | None = None, shards: int = 1) -> dict[str, torch.Tensor]:
    (folder / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    config = load_config(folder)
    tensors = {name: torch.randn(shape) for name, shape in expected_shapes(config).items()}
    stored = {k: v.to(torch.bfloat16) for k, v in tensors.items() if k != drop}
    names = sorted(stored)
    if shards == 1:
        save_file(stored, folder / "model.safetensors")
        return tensors
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: stored[n] for n in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_directory_loads_every_tensor(tmp_path: Path, shards: int) -> None:
    written = _write_hf_dir(tmp_path, shards=shards)
    config, tensors = load_model(tmp_path)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 4)
    assert config.eos_token_ids == (2, 3) and config.bos_token_id == 1 and not config.tie_word_embeddings
    assert config.rope_scaling is None and not config.attention_bias
    assert set(tensors) == set(written)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, written[name].to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_directory_loads_in_the_models_dtype_the_values_its_float32_tensors_round_to(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    _write_hf_dir(tmp_path, shards=3)
    _, wide = load_model(tmp_path)
    unread = {"model.layers.0.mlp.up_proj.weight"}
    _, narrow = load_model(tmp_path, shape_only=unread, dtype=dtype)
    assert set(narrow) == set(wide)
    for name, tensor in narrow.items():
        assert tensor.dtype == dtype and tensor.is_meta == (name in unread), name
        if name not in unread:
            assert torch.equal(tensor, wide[name].to(dtype)), name


def test_hf_directory_leaves_shape_only_tensors_unread(tmp_path: Path) -> None:
    written = _write_hf_dir(tmp_path, shards=3)
    unread = {"model.layers.1.mlp.down_proj.weight", "lm_head.weight"}
    _, tensors = load_model(tmp_path, shape_only=unread)
    assert set(tensors) == set(written)
    for name, tensor in tensors.items():
        assert tensor.is_meta == (name in unread) and tensor.shape == written[name].shape
        if name not in unread:
            torch.testing.assert_close(tensor, written[name].to(torch.bfloat16).float(), rtol=0, atol=0)
    (tmp_path / "short").mkdir()
    _write_hf_dir(tmp_path / "short", drop="lm_head.weight")  # one missing is still named
    with pytest.raises(ModelLoadError, match=r"'lm_head\.weight' is missing"):
        load_model(tmp_path / "short", shape_only=unread)


def test_hf_directory_missing_tensor_is_named(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(tmp_path)


def test_hf_directory_misshapen_or_duplicate_tensor_is_named(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path, drop="model.norm.weight")
    save_file({"model.norm.weight": torch.ones(17)}, tmp_path / "extra.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \[17\], expected \[16\]"):
        load_model(tmp_path)
    save_file(
        {"model.norm.weight": torch.ones(16), "lm_head.weight": torch.ones(32, 16)},
        tmp_path / "extra.safetensors",
    )
    with pytest.raises(ModelLoadError, match=r"'lm_head\.weight' is also stored"):
        load_model(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_tensor_with_a_value_that_is_not_finite_is_named(tmp_path: Path, value: float) -> None:
    written = _write_hf_dir(tmp_path)
    poisoned = written["model.layers.1.self_attn.o_proj.weight"].clone()
    poisoned[5, 3] = value
    stored = {name: tensor.to(torch.bfloat16) for name, tensor in written.items()}
    save_file({**stored, "model.layers.1.self_attn.o_proj.weight": poisoned}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' contains NaN"):
        load_model(tmp_path)


def test_a_value_past_the_models_dtype_is_named_with_that_dtype(tmp_path: Path) -> None:
    """1e5 is a finite bfloat16 but past float16's range: a float16 model cannot hold it."""
    written = _write_hf_dir(tmp_path)
    large = written["model.layers.0.mlp.up_proj.weight"].clone()
    large[2, 7] = 1e5
    stored = {name: tensor.to(torch.bfloat16) for name, tensor in written.items()}
    save_file(
        {**stored, "model.layers.0.mlp.up_proj.weight": large.bfloat16()}, tmp_path / "model.safetensors"
    )
    load_model(tmp_path, dtype=torch.bfloat16)  # it holds it
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' contains NaN or infinite values as float16",
    ):
        load_model(tmp_path, dtype=torch.float16)


def test_tensors_read_elsewhere_fill_the_unread_ones_checked_as_read_ones(tmp_path: Path) -> None:
    """The worker widens blocks into the dense copies load_model left unread (gpu_worker/startup.py)."""
    written = _write_hf_dir(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"
    _, tensors = load_model(tmp_path, shape_only={name})
    good = written[name].clone()
    for bad, message in [
        (good[:, :-1], r"has shape \[16, 23\], expected \[16, 24\]"),
        (good / 0, "contains NaN"),
    ]:
        with pytest.raises(ModelLoadError, match=re.escape(name) + "' " + message):
            fill_unread(tensors, {name: bad}, tmp_path)
        assert tensors[name].is_meta
    fill_unread(tensors, {name: good}, tmp_path)
    assert tensors[name] is good


def test_hf_config_missing_key_is_named(tmp_path: Path) -> None:
    config = dict(TINY_HF_CONFIG)
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'hidden_size' is missing"):
        load_model(tmp_path)


def test_missing_and_corrupt_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelLoadError, match=re.escape(str(missing))):
        load_model(missing)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF but not really" * 10)
    with pytest.raises(ModelLoadError, match=re.escape(str(corrupt))):
        load_model(corrupt)
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path)  # a directory without config.json


def test_default_gguf_config() -> None:
    path = find_default_model()
    assert path.suffix == ".gguf" and path.is_file()
    config = load_config(path)
    assert config == ModelConfig(
        name="SmolLM2-135M-Instruct",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=100000.0,
        rope_scaling=None,
        context_length=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert config.rms_norm_eps == pytest.approx(1e-5)


@pytest.mark.slow
def test_default_gguf_tensors() -> None:
    config, tensors = load_model(find_default_model())
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_shapes(config)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert "lm_head.weight" not in tensors
    unread = {"model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.gate_proj.weight"}
    _, some = load_model(find_default_model(), shape_only=unread)
    assert {name for name, t in some.items() if t.is_meta} == unread
    assert all(torch.equal(t, tensors[name]) for name, t in some.items() if name not in unread)
    assert all(some[name].shape == tensors[name].shape for name in unread)


@pytest.mark.slow
def test_default_gguf_loads_in_bfloat16_the_values_its_float32_tensors_round_to() -> None:
    """A bfloat16 worker's state dict: each tensor dequantized, then rounded as its parameter would
    round it, before the next is read."""
    _, wide = load_model(find_default_model())
    unread = {"model.layers.5.mlp.down_proj.weight"}
    _, narrow = load_model(find_default_model(), shape_only=unread, dtype=torch.bfloat16)
    assert set(narrow) == set(wide)
    for name, tensor in narrow.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_meta == (name in unread), name
        if name not in unread:
            assert torch.equal(tensor, wide[name].bfloat16()), name


def test_kv_cache_layout() -> None:
    config = ModelConfig(
        name="t",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        rope_scaling=None,
        context_length=32,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(),
    )
    caches = allocate_kv_cache(config, num_blocks=5, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert len(caches) == 3
    assert all(k.shape == v.shape == (5, 16, 2, 2) and k.dtype == torch.bfloat16 for k, v in caches)
    per_block = kv_cache_bytes_per_block(config, 16, torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 2 * 2
    assert sum(k.nbytes + v.nbytes for k, v in caches) == 5 * per_block
    # Zero-filled, contiguous, and every tensor its own memory.
    tensors = [t for pair in caches for t in pair]
    assert all(t.is_contiguous() and not t.any() for t in tensors)
    for index, tensor in enumerate(tensors):
        tensor.fill_(index + 1)
    assert [int(t.unique().item()) for t in tensors] == list(range(1, 7))

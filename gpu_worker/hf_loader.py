"""A Hugging Face directory's model: `config.json` and `*.safetensors`, optionally sharded with
an index. Its tensors in float32, and its 16-bit linears as stored for the block linear."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from gpu_worker.model_config import Llama3RopeScaling, ModelConfig, ModelLoadError
from kernels.block_weights import DENSE_TYPES, BlockWeight

_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_hf_directory(
    path: Path, shape_only: Collection[str], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    config = _hf_config(config_file, _read_json(config_file), default_name=path.name)
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        for name, tensor in _read_safetensors(file, shape_only=shape_only, dtype=dtype):
            if name in tensors:
                raise ModelLoadError(f"{file}: tensor {name!r} is also stored in another file of {path}")
            tensors[name] = tensor
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, tensors


def hf_block_weights(path: Path) -> dict[str, BlockWeight]:
    found: dict[str, BlockWeight] = {}
    for file in _safetensors_files(path):
        for name, tensor in _read_safetensors(file, dtype=None):
            if tensor.dim() == 2 and tensor.dtype in DENSE_TYPES and tensor.shape[1] % 32 == 0:
                found[name] = BlockWeight.dense(tensor.contiguous())
    return found


def hf_config(path: Path) -> ModelConfig:
    """The directory's architecture, from its config.json."""
    config_file = path / "config.json"
    return _hf_config(config_file, _read_json(config_file), default_name=path.name)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise ModelLoadError(f"{file.parent}: directory has no {file.name}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _hf_config(config_file: Path, raw: Mapping[str, Any], default_name: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ModelLoadError(
            f"{config_file}: model_type is {model_type!r}; supported: {list(_HF_MODEL_TYPES)}"
        )

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelLoadError(f"{config_file}: key {key!r} is missing")
        return raw[key]

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{config_file}: hidden_act {act!r} is unsupported (only 'silu')")
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{config_file}: mlp_bias=true is unsupported")
    window = raw.get("sliding_window")
    if (
        window is not None
        and raw.get("use_sliding_window", True)
        and window < raw.get("max_position_embeddings", 0)
    ):
        raise ModelLoadError(f"{config_file}: sliding_window={window} attention is unsupported")
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = raw.get("bos_token_id")
    return ModelConfig(
        name=str(raw.get("_name_or_path") or default_name).rstrip("/").split("/")[-1] or default_name,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_hf_rope_scaling(config_file, rope),
        context_length=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def _hf_rope_scaling(config_file: Path, rope: Mapping[str, Any]) -> Llama3RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelLoadError(f"{config_file}: rope type {rope_type!r} is unsupported (default or 'llama3')")
    try:
        scaling = Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{config_file}: llama3 rope scaling lacks key {exc.args[0]!r}") from exc
    if not (scaling.factor > 0 and scaling.high_freq_factor > scaling.low_freq_factor > 0):
        raise ModelLoadError(f"{config_file}: llama3 rope scaling has invalid factors {scaling}")
    if not math.isfinite(scaling.factor):
        raise ModelLoadError(f"{config_file}: llama3 rope factor is not finite")
    return scaling


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index}: shard {file.name} listed in weight_map does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    return files


def _read_safetensors(
    file: Path, shape_only: Collection[str] = (), dtype: torch.dtype | None = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, in `dtype` (None: each in the dtype the file stores it in); those in
    `shape_only` unread, as `dtype` tensors of their shapes on the "meta" device."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in shape_only:
                    assert dtype is not None, "a tensor left unread needs a dtype to stand in"
                    shape = handle.get_slice(name).get_shape()
                    yield name, torch.empty(shape, dtype=dtype, device="meta")
                    continue
                tensor = handle.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc

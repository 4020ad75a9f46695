"""Model files → (ModelConfig, float32 state dict with Hugging Face Llama tensor names).

Two formats: a GGUF file (read by scheduler/gguf_file.py, dequantized with the `gguf` package) and a Hugging Face
directory (`config.json` + `*.safetensors`, optionally sharded with an index). Everything
that can be wrong with a model file is reported as a `ModelLoadError` naming the file and
the key or tensor at fault. `load_block_weights` also gives a GGUF file's
linears in their own blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, Q2_K to Q6_K, IQ4_XS, the
codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, the ternary TQ1_0 and TQ2_0,
and the 4-bit floats MXFP4 and NVFP4), which the CPU's block kernel multiplies without
dequantizing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.block_weights import BLOCK_BYTES, DENSE_TYPES, BlockWeight
from scheduler.gguf_file import GGUFFile, read_gguf

_GGUF_ARCHITECTURES = ("llama",)
_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")


class ModelLoadError(ValueError):
    """A model file is missing, unreadable, of an unsupported kind, or inconsistent."""


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.x "llama3" rotary frequency scaling parameters."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, independent of the file format it came from."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model(
    path: str | Path, shape_only: Collection[str] = ()
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a .gguf file or an HF directory; tensors are float32 with HF Llama names, validated.
    The tensors named in `shape_only` are not read: they come back as float32 tensors on the
    "meta" device, their shapes checked (for weights the caller multiplies as the files store them,
    `load_block_weights`)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config, tensors = _load_hf_directory(path, shape_only)
    elif path.suffix == ".gguf":
        config, tensors = _load_gguf(path, shape_only)
    else:
        raise ModelLoadError(f"model path {path} is neither a .gguf file nor a directory with config.json")
    return config, validate_state_dict(config, tensors, path)


def load_config(path: str | Path) -> ModelConfig:
    """Read only the architecture of a .gguf file or HF directory (no tensor data is decoded)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config_file = path / "config.json"
        return _hf_config(config_file, _read_json(config_file), default_name=path.name)
    if path.suffix == ".gguf":
        reader = _gguf_reader(path)
        return _gguf_config(path, _gguf_metadata(reader), {t.name: tuple(t.shape) for t in reader.tensors})
    raise ModelLoadError(f"model path {path} is neither a .gguf file nor a directory with config.json")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with its shape."""
    h, ffn = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    return shapes


def validate_state_dict(
    config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: Path
) -> dict[str, torch.Tensor]:
    """Keep exactly the tensors the config needs; raise naming the first missing or misshapen one."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing (expected shape {list(shape)})")
        _check_tensor(name, tensor, shape, source)
        out[name] = tensor
    return out


def fill_unread(weights: dict[str, torch.Tensor], found: Mapping[str, torch.Tensor], source: Path) -> None:
    """Put the tensors of `found` in place of the ones `load_model` left unread (`shape_only`),
    each checked as `load_model` checks what it reads."""
    for name, tensor in found.items():
        unread = weights[name]
        assert unread.is_meta, f"{name} was read already"
        _check_tensor(name, tensor, tuple(unread.shape), source)
        weights[name] = tensor


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...], source: Path) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(
            f"{source}: tensor {name!r} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    if not tensor.is_meta and tensor.numel() and not _finite(tensor):
        raise ModelLoadError(f"{source}: tensor {name!r} contains NaN or infinite values")


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: the least and the greatest are (both propagate NaN). One pass
    and no mask; `isfinite(...).all()` took 0.43 s of the default model's load."""
    return all(bool(torch.isfinite(bound)) for bound in torch.aminmax(tensor))


# ---------------------------------------------------------------------------------------------
# GGUF


def _gguf_reader(path: Path) -> GGUFFile:
    try:
        return read_gguf(path, arrays=False)  # nothing here reads the tokenizer's arrays
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _load_gguf(path: Path, shape_only: Collection[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = _gguf_reader(path)
    config = _gguf_config(path, _gguf_metadata(reader), {t.name: tuple(t.shape) for t in reader.tensors})
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        hf_name = _gguf_to_hf_name(t.name)
        if hf_name is None:
            if t.name == "rope_freqs.weight":
                raise ModelLoadError(
                    f"{path}: tensor 'rope_freqs.weight' (per-frequency rope factors) is unsupported"
                )
            continue
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        if hf_name in shape_only:
            tensors[hf_name] = torch.empty(shape, dtype=torch.float32, device="meta")
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name}"
            ) from exc
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # F32 tensors come back as views of the memory-mapped file
            array = array.copy()
        weight = torch.from_numpy(array)
        if hf_name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            weight = _unpermute_rotary_rows(weight, config.num_heads, config.head_dim)
        elif hf_name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            weight = _unpermute_rotary_rows(weight, config.num_kv_heads, config.head_dim)
        tensors[hf_name] = weight
    return config, tensors


def load_block_weights(
    path: str | Path, config: ModelConfig, sixteen_bit: bool = True
) -> dict[str, BlockWeight]:
    """The model's 2-D weights as its files store them, by Hugging Face name, for the block linear
    (kernels/cpu_block_linear.py): a GGUF file's stored as Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL,
    Q2_K to Q6_K, IQ4_XS, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0,
    MXFP4, NVFP4, F16 or BF16 (q and k rows in Hugging Face's order, as `load_model` gives them), a
    Hugging Face directory's stored as float16 or bfloat16. F32 weights are left out, and
    the 16-bit ones unless `sixteen_bit` (a bfloat16 model multiplies on its own weights instead,
    no copy needed)."""
    path = Path(path)
    if path.is_dir():
        return _hf_block_weights(path) if sixteen_bit else {}
    found: dict[str, BlockWeight] = {}
    for t in _gguf_reader(path).tensors:
        hf_name = _gguf_to_hf_name(t.name)
        if (
            hf_name is None
            or len(t.shape) != 2
            or int(t.tensor_type) not in BLOCK_BYTES
            or (int(t.tensor_type) in DENSE_TYPES.values() and not sixteen_bit)
            or int(t.shape[0]) % 32  # F16/BF16 rows need not be in 32s; the kernel's must
        ):
            continue
        # Off the memory map, as bytes: F16 tensors read as float16 elements, the others as bytes.
        blocks = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8).reshape(int(t.shape[1]), -1))
        if hf_name.endswith("self_attn.q_proj.weight"):
            blocks = _unpermute_rotary_rows(blocks, config.num_heads, config.head_dim)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            blocks = _unpermute_rotary_rows(blocks, config.num_kv_heads, config.head_dim)
        found[hf_name] = BlockWeight(int(t.tensor_type), blocks, int(t.shape[0]))
    return found


def _gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Scalar and string metadata by key; arrays (the tokenizer's 49k-entry lists) are represented by
    their length only, under "<key>.length", since nothing here needs them."""
    out: dict[str, Any] = {
        name: value for name, value in reader.fields.items() if name not in reader.array_types
    }
    out.update((f"{name}.length", length) for name, length in reader.array_lengths.items())
    return out


def _gguf_config(
    path: Path, fields: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: general.architecture is {arch!r}; "
            f"supported GGUF architectures: {list(_GGUF_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = fields.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: metadata key '{arch}.{key}' is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv") or heads)
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    rot_dims = int(fields.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot_dims != head_dim:
        raise ModelLoadError(
            f"{path}: '{arch}.rope.dimension_count' is {rot_dims} but head_dim is {head_dim}; "
            "partial rotary embeddings are unsupported"
        )
    scaling_type = fields.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: '{arch}.rope.scaling.type' = {scaling_type!r} is unsupported")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = (
            fields.get("tokenizer.ggml.tokens.length") or tensor_shapes.get("token_embd.weight", (0, 0))[1]
        )
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = fields.get(key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = fields.get("tokenizer.ggml.bos_token_id")
    name = path.stem
    file_type = name.rsplit(".", 1)
    if len(file_type) == 2 and file_type[1].upper().startswith(("Q", "F", "BF", "IQ")):
        name = file_type[0]
    return ModelConfig(
        name=name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=None,
        context_length=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        suffix = _GGUF_LAYER_NAMES.get(rest)
        if suffix is not None:
            return f"model.layers.{int(index)}.{suffix}"
    return None


def _unpermute_rotary_rows(weight: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (rotary pairs interleaved) back to HF's half-split order.

    Within each head GGUF stores the rows of rotary pair j at 2j and 2j+1; HF stores them at
    j and j + head_dim/2.
    """
    rest = weight.shape[1:]
    # [heads, head_dim/2 (pair), 2 (member), *rest] → [heads, 2, head_dim/2, *rest]
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return w.reshape(num_heads * head_dim, *rest).contiguous()


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


def _load_hf_directory(
    path: Path, shape_only: Collection[str]
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    config = _hf_config(config_file, _read_json(config_file), default_name=path.name)
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        for name, tensor in _read_safetensors(file, shape_only=shape_only):
            if name in tensors:
                raise ModelLoadError(f"{file}: tensor {name!r} is also stored in another file of {path}")
            tensors[name] = tensor
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, tensors


def _hf_block_weights(path: Path) -> dict[str, BlockWeight]:
    found: dict[str, BlockWeight] = {}
    for file in _safetensors_files(path):
        for name, tensor in _read_safetensors(file, as_stored=True):
            if tensor.dim() == 2 and tensor.dtype in DENSE_TYPES and tensor.shape[1] % 32 == 0:
                found[name] = BlockWeight.dense(tensor.contiguous())
    return found


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
    file: Path, as_stored: bool = False, shape_only: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, in float32 or (`as_stored`) in the file's dtypes; those in `shape_only`
    unread, as float32 tensors of their shapes on the "meta" device."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in shape_only:
                    shape = handle.get_slice(name).get_shape()
                    yield name, torch.empty(shape, dtype=torch.float32, device="meta")
                    continue
                tensor = handle.get_tensor(name)
                yield name, tensor if as_stored else tensor.to(torch.float32)
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from exc

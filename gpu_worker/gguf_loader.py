"""A GGUF file's model: its architecture from the metadata, its tensors under Hugging Face Llama
names (dequantized with the `gguf` package, q and k rows back in Hugging Face's order), and its
linears' blocks as stored. The file itself is read by scheduler/gguf_file.py."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker.model_config import ModelConfig, ModelLoadError
from kernels.block_weights import BLOCK_BYTES, DENSE_TYPES, BlockWeight
from scheduler.gguf_file import GGUFFile, read_gguf

_GGUF_ARCHITECTURES = ("llama",)


def _gguf_reader(path: Path) -> GGUFFile:
    try:
        return read_gguf(path, arrays=False)  # nothing here reads the tokenizer's arrays
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def load_gguf(
    path: Path, shape_only: Collection[str], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The file's tensors as load_model gives them: dequantized, each converted to `dtype` before
    the next is read."""
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
            tensors[hf_name] = torch.empty(shape, dtype=dtype, device="meta")
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
        tensors[hf_name] = weight.to(dtype)
    return config, tensors


def gguf_config(path: Path) -> ModelConfig:
    """The file's architecture, no tensor data decoded."""
    reader = _gguf_reader(path)
    return _gguf_config(path, _gguf_metadata(reader), {t.name: tuple(t.shape) for t in reader.tensors})


def gguf_block_weights(path: Path, config: ModelConfig, sixteen_bit: bool) -> dict[str, BlockWeight]:
    """The 2-D weights of a GGUF file the block linear multiplies as stored (see load_block_weights),
    q and k rows in Hugging Face's order."""
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

"""Model files → (ModelConfig, state dict with Hugging Face Llama tensor names, in float32 or the
model's dtype).

Two formats: a GGUF file (gpu_worker/gguf_loader.py) and a Hugging Face directory
(gpu_worker/hf_loader.py). Everything that can be wrong with a model file is reported as a
`ModelLoadError` naming the file and the key or tensor at fault. `load_block_weights` also gives a
GGUF file's linears in their own blocks (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, IQ4_NL, Q2_K to Q6_K,
IQ4_XS, the codebook types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, the ternary TQ1_0
and TQ2_0, and the 4-bit floats MXFP4 and NVFP4), which the CPU's block kernel multiplies without
dequantizing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from gpu_worker.gguf_loader import gguf_block_weights, gguf_config, load_gguf
from gpu_worker.hf_loader import hf_block_weights, hf_config, load_hf_directory
from gpu_worker.model_config import ModelConfig, ModelLoadError, expected_shapes
from kernels._launch import dtype_name
from kernels.block_weights import BlockWeight


def load_model(
    path: str | Path, shape_only: Collection[str] = (), dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a .gguf file or an HF directory; tensors are in `dtype` with HF Llama names, validated.
    Each is converted as it is read (a GGUF file's dequantized to float32 first), so a bfloat16
    model's state dict takes half the memory of a float32 one, with the values its parameters
    would round them to anyway. The tensors named in `shape_only` are not read: they come back as
    tensors on the "meta" device, their shapes checked (for weights the caller multiplies as the
    files store them, `load_block_weights`)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        config, tensors = load_hf_directory(path, shape_only, dtype)
    elif path.suffix == ".gguf":
        config, tensors = load_gguf(path, shape_only, dtype)
    else:
        raise ModelLoadError(f"model path {path} is neither a .gguf file nor a directory with config.json")
    return config, validate_state_dict(config, tensors, path)


def load_config(path: str | Path) -> ModelConfig:
    """Read only the architecture of a .gguf file or HF directory (no tensor data is decoded)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        return hf_config(path)
    if path.suffix == ".gguf":
        return gguf_config(path)
    raise ModelLoadError(f"model path {path} is neither a .gguf file nor a directory with config.json")


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
        return hf_block_weights(path) if sixteen_bit else {}
    return gguf_block_weights(path, config, sixteen_bit)


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
        # A finite value past a narrower dtype's range (float16's 65504) reads as infinite there.
        held = "" if tensor.dtype == torch.float32 else f" as {dtype_name(tensor.dtype)}"
        raise ModelLoadError(f"{source}: tensor {name!r} contains NaN or infinite values{held}")


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: the least and the greatest are (both propagate NaN). One pass
    and no mask; `isfinite(...).all()` took 0.43 s of the default model's load."""
    return all(bool(torch.isfinite(bound)) for bound in torch.aminmax(tensor))

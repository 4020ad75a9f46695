"""What every kernel launcher shares: argument checks that name the argument, and Triton's interpreter switch."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32() -> bool:
    """Whether kernels cast tl.dot operands to float32 first.

    Triton's interpreter (3.x) multiplies bfloat16 operands of tl.dot wrongly, so interpreted
    runs (the CPU tests) take the float32 path; on a GPU the operands stay in their own dtype
    for the tensor cores.
    """
    return interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact ("ieee") for float32 inputs, which would otherwise round
    to tf32 on the GPU's tensor cores; 16-bit inputs are exact either way."""
    return "ieee" if dtype == torch.float32 or dot_in_fp32() else "tf32"


def device_ok(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" or (interpreting() and tensor.device.type == "cpu")


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of a dtype without its module: "bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def require(ok: bool, name: str, tensor: torch.Tensor, expected: str) -> None:
    if not ok:
        raise ValueError(
            f"{name}: expected {expected}, got shape {tuple(tensor.shape)} {tensor.dtype} "
            f"strides {tensor.stride()} on {tensor.device}"
        )


def require_tensor(
    tensor: torch.Tensor,
    name: str,
    *,
    dims: int,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    contiguous: bool = True,
    cpu: bool = False,
) -> None:
    """`tensor` has `dims` dimensions, one of `dtypes`, is contiguous (when asked) and on a kernel
    device: the CPU for the C kernels (`cpu`), else CUDA (or the CPU under TRITON_INTERPRET=1)."""
    require(tensor.dim() == dims, name, tensor, f"{dims} dimensions")
    require(tensor.dtype in dtypes, name, tensor, f"dtype in {tuple(str(d) for d in dtypes)}")
    require(not contiguous or tensor.is_contiguous(), name, tensor, "a contiguous tensor")
    if cpu:
        require(tensor.device.type == "cpu", name, tensor, "a CPU tensor")
    else:
        require(device_ok(tensor), name, tensor, "a CUDA tensor (or a CPU one under TRITON_INTERPRET=1)")


def require_contiguous(
    tensor: torch.Tensor, name: str, shape: Sequence[int | str], dtype: torch.dtype
) -> None:
    """`tensor` is contiguous, of `dtype`, and of `shape`: an int is a size it must have, a string
    (such as "max_blocks") names a size that may be any."""
    ok = (
        tensor.dim() == len(shape)
        and tensor.dtype == dtype
        and tensor.is_contiguous()
        and all(isinstance(want, str) or size == want for size, want in zip(tensor.shape, shape, strict=True))
    )
    sizes = ", ".join(str(size) for size in shape)
    require(ok, name, tensor, f"a contiguous {dtype_name(dtype)} [{sizes}] tensor")


def require_token_rows(tensor: torch.Tensor, name: str, cpu: bool = False) -> None:
    """[T, heads, D] whose rows may be strided (views into qkv) but each row's heads and dims are packed."""
    require_tensor(tensor, name, dims=3, contiguous=False, cpu=cpu)
    require(
        tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2],
        name,
        tensor,
        "each token's heads and dims contiguous",
    )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

"""The argument checks every kernel launcher shares (kernels/_launch.py)."""

from __future__ import annotations

import pytest
import torch

from kernels._launch import dtype_name, require_contiguous


def test_a_contiguous_tensor_of_the_dtype_and_the_fixed_sizes_passes_whatever_its_named_sizes() -> None:
    for width in (1, 7):
        require_contiguous(torch.zeros(3, width, dtype=torch.int32), "tables", (3, "max_blocks"), torch.int32)


@pytest.mark.parametrize(
    ("tensor", "got"),
    [
        (torch.zeros(3, 4, dtype=torch.int64), r"got shape \(3, 4\) torch\.int64"),  # the dtype
        (torch.zeros(2, 4, dtype=torch.int32), r"got shape \(2, 4\) torch\.int32"),  # a fixed size
        (torch.zeros(3, dtype=torch.int32), r"got shape \(3,\) torch\.int32"),  # the dimensions
        (
            torch.zeros(4, 3, dtype=torch.int32).t(),
            r"got shape \(3, 4\) torch\.int32 strides \(1, 3\)",
        ),  # the layout
    ],
)
def test_any_other_tensor_is_refused_naming_the_argument_and_what_it_should_be(
    tensor: torch.Tensor, got: str
) -> None:
    with pytest.raises(
        ValueError, match=rf"^tables: expected a contiguous int32 \[3, max_blocks\] tensor, {got}"
    ):
        require_contiguous(tensor, "tables", (3, "max_blocks"), torch.int32)


def test_a_dtype_is_named_without_its_module() -> None:
    assert [dtype_name(d) for d in (torch.bfloat16, torch.float32, torch.int8)] == [
        "bfloat16",
        "float32",
        "int8",
    ]

"""Test-session setup shared by every test directory."""

from __future__ import annotations

import os

import torch

# Triton kernels run through Triton's interpreter on the CPU when there is no GPU; the
# variable must be set before any @triton.jit function is defined (kernels are imported lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

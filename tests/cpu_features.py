"""What this CPU offers the C kernels, for the tests that need it."""

from __future__ import annotations

from kernels.cpu_build import AMX, BF16_DOT, cpu_has


def has_avx512_bf16() -> bool:
    return cpu_has("avx512_bf16")


def has_avx2_fma() -> bool:
    """What the float32 kernels (block linear, prefill attention) need."""
    return cpu_has("avx2") and cpu_has("fma")


def engines_here() -> list[str]:
    """The engines a two-engine CPU kernel runs on here: dot products wherever AVX-512 BF16 is,
    AMX tiles too where the CPU has them."""
    return [BF16_DOT, *([AMX] if cpu_has("amx_bf16") else [])]

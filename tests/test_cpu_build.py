"""Building and loading the CPU kernels (kernels/cpu_build.py) leaves the loading thread's float
arithmetic as it was: a library linked with -ffast-math would turn on flush-to-zero there."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels.cpu_build import SOURCES, KernelBuildError, build, load, parts, splits_512_bit_operations

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch

    from kernels.cpu_build import KernelBuildError
    from kernels.cpu_block_linear import load_block_linear
    from kernels.cpu_decode import load_cpu_decode_attention
    from kernels.cpu_fused import load_cpu_fused_ops
    from kernels.cpu_prefill import load_prefill_attention
    from kernels.cpu_stack import load_cpu_decode_stack

    TINY = np.float32(1e-39)  # below float32's smallest normal number

    def subnormals_survive():
        return float((np.array([TINY]) * np.float32(1.0))[0]) != 0.0 and float(torch.tensor(1e-39) * 1.0) != 0.0

    assert subnormals_survive(), "subnormals flushed before any kernel was loaded"
    loaded = []
    for name, load in [
        ("block linear", load_block_linear),
        ("fused ops", lambda: load_cpu_fused_ops(torch.float32)),
        ("decode attention", lambda: load_cpu_decode_attention(64, 3, 16, torch.float32)),
        ("block decode stack", lambda: load_cpu_decode_stack(64, 3, 16, blocks=True)),
        ("prefill attention", lambda: load_prefill_attention(64, dtype=torch.float32)),
    ]:
        try:
            load()
        except KernelBuildError:
            continue
        loaded.append(name)
        assert subnormals_survive(), f"loading the {name} turned on flush-to-zero"
    print(",".join(loaded))
    """
)


def test_loading_a_kernel_keeps_subnormal_floats() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    # Every CPU CI runs on builds at least the block linear (AVX2, FMA, F16C) and the fused ops.
    assert {"block linear", "fused ops"} <= set(result.stdout.strip().split(","))


def cpuinfo(vendor: str, family: int, flags: str) -> str:
    """Two processors' lines of /proc/cpuinfo, the second's family different (only the first counts)."""
    one = f"processor\t: {{}}\nvendor_id\t: {vendor}\ncpu family\t: {{}}\nflags\t\t: {flags}\n"
    return one.format(0, family) + "\n" + one.format(1, family + 1)


def test_zen_4_alone_splits_512_bit_operations() -> None:
    """The CPUs whose 512-bit operations run as two halves: AMD's family 25 with AVX-512 (Zen 4),
    not Zen 3 (no AVX-512), Zen 5 or Intel's."""
    avx512 = "fpu sse avx2 avx512f avx512bw avx512_bf16"
    assert splits_512_bit_operations(cpuinfo("AuthenticAMD", 25, avx512))
    assert not splits_512_bit_operations(cpuinfo("AuthenticAMD", 25, "fpu sse avx2 fma"))
    assert not splits_512_bit_operations(cpuinfo("AuthenticAMD", 26, avx512))
    assert not splits_512_bit_operations(cpuinfo("GenuineIntel", 6, avx512 + " amx_bf16"))
    assert not splits_512_bit_operations("")


def prebuild(cache: Path | None = None, compiler: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if cache is not None:
        env["DUOSERVE_KERNEL_CACHE"] = str(cache)
    if compiler is not None:
        env["CC"] = compiler
    return subprocess.run(
        [sys.executable, "-m", "kernels.cpu_prebuild"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_prebuild_readies_the_shape_free_kernels() -> None:
    """`make test` ran it before the tests, so here it finds them in the cache."""
    result = prebuild()
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines()[:-1])
    assert set(lines) == {
        "block linear, bfloat16 x",
        "block linear, float32 x",
        "fused ops, float32",
        "fused ops, bfloat16",
        "pair-layout linear",
    }
    # Every CPU CI runs on has AVX2, FMA and F16C; the fused ops are portable C.
    for name in (
        "block linear, float32 x",
        "block linear, bfloat16 x",
        "fused ops, float32",
        "fused ops, bfloat16",
    ):
        assert lines[name].startswith("ready in "), (name, lines[name])
    assert result.stdout.splitlines()[-1].endswith(" s")


def test_prebuild_fails_when_the_compiler_does(tmp_path: Path) -> None:
    result = prebuild(cache=tmp_path, compiler="false")
    assert result.returncode == 1
    assert "kernel build failed" in result.stderr and "false --version failed" in result.stderr
    assert not list(tmp_path.glob("*.so"))


TWO_PARTS = """
#define PARTS 2
__attribute__((visibility("hidden"))) int doubled(int x);
#if PART == 0
__attribute__((visibility("hidden"))) int doubled(int x) { return 2 * x; }
#else
int duoserve_doubled_plus(int x, int y) { return doubled(x) + y; }
#endif
"""


@pytest.fixture
def two_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """kernels/cpu as a directory that holds TWO_PARTS as two.c, and an empty kernel cache beside it."""
    monkeypatch.setenv("DUOSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    sources = tmp_path / "cpu"
    sources.mkdir()
    (sources / "two.c").write_text(TWO_PARTS)
    return sources


def test_a_source_built_in_parts_links_them_into_one_library(two_parts: Path) -> None:
    library = load(build("two.c", {}, two_parts))
    library.duoserve_doubled_plus.argtypes = [ctypes.c_int, ctypes.c_int]
    assert library.duoserve_doubled_plus(20, 2) == 42
    assert not hasattr(library, "doubled")  # hidden: each part's own, not the library's
    cache = two_parts.parent / "cache"
    assert [path.name for path in cache.iterdir()] == [build("two.c", {}, two_parts).name]


def test_a_build_says_when_it_starts_compiling_and_a_cached_one_says_nothing(
    two_parts: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A first start compiles for up to half a minute: the log says so before, not only after."""
    with caplog.at_level("INFO", logger="kernels.cpu_build"):
        target = build("two.c", {}, two_parts)
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("compiling the CPU kernel two for this CPU, once")
    assert str(two_parts.parent / "cache") in said[0]
    assert re.fullmatch(rf"built the CPU kernel {re.escape(str(target))} in \d+\.\d s", said[1])
    caplog.clear()
    with caplog.at_level("INFO", logger="kernels.cpu_build"):
        assert build("two.c", {}, two_parts) == target
    assert caplog.records == []


def test_a_part_that_fails_to_compile_fails_the_build_and_leaves_nothing(two_parts: Path) -> None:
    (two_parts / "two.c").write_text(TWO_PARTS.replace("#else", "#else\nnot C;"))
    with pytest.raises(KernelBuildError, match="-DPART=1") as failed:
        build("two.c", {}, two_parts)
    assert "-DPART=0" not in str(failed.value)  # only the part that failed is named
    assert list((two_parts.parent / "cache").iterdir()) == []


def test_the_block_linear_declares_its_parts_and_other_sources_build_whole() -> None:
    assert parts("int x;\n#define PARTS 3\n") == 3
    assert parts("/* #define PARTS 3 */\nint x;\n") == 1
    assert parts((SOURCES / "block_linear.c").read_text()) == 3
    assert parts((SOURCES / "fused_ops.c").read_text()) == 1

"""Building the CPU kernels in kernels/cpu/: compiled on first use with the system C compiler.

Each library is compiled for this CPU (`-march=native`) with its shape constants fixed by
`-D` defines, into a cache directory (`$DUOSERVE_KERNEL_CACHE`, else
`~/.cache/duoserve/kernels`) keyed by the sources and headers in kernels/cpu/, the flags, the
compiler and the CPU, and
loaded with ctypes after torch, so its OpenMP calls share torch's libgomp and thread pool.
No compiler, or a CPU the source cannot target, raises `KernelBuildError`; callers then keep
their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

SOURCES = Path(__file__).with_name("cpu")


class KernelBuildError(RuntimeError):
    """A kernel cannot be built or loaded here (no compiler, unsupported shape or CPU, failed compile)."""


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"C compiler {compiler!r} not found (set CC, or install gcc)")
    return compiler


def _base_flags() -> list[str]:
    flags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-mprefer-vector-width=512")  # the kernels' loops are 64+ floats wide
    return flags


# The link is a separate step without -ffast-math: with it, GCC before 13 links crtfastmath.o into
# the library, whose constructor turns on flush-to-zero and denormals-are-zero in whichever thread
# loads it, changing every later float operation of that thread (torch's included).
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_identity() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has(flag: str) -> bool:
    """Whether the CPU lists this flag (/proc/cpuinfo's names, e.g. avx512_bf16, amx_bf16)."""
    return flag in _cpu_identity().split()


def splits_512_bit_operations(cpuinfo: str | None = None) -> bool:
    """True on a CPU that runs each 512-bit vector operation as two 256-bit halves: AMD's with
    AVX-512 and family 25 (Zen 4). Zen 5 (family 26) and Intel's Xeons run them whole.
    `cpuinfo`: /proc/cpuinfo's text (by default, read here)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():  # the first processor's
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    return (
        fields.get("vendor_id") == "AuthenticAMD"
        and fields.get("cpu family") == "25"
        and "avx512f" in fields.get("flags", "").split()
    )


def cache_dir() -> Path:
    if configured := os.environ.get("DUOSERVE_KERNEL_CACHE"):
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "duoserve" / "kernels"


def parts(source_text: str) -> int:
    """How many objects a source is compiled as: its own `#define PARTS n` line, else one."""
    found = re.search(r"^#define PARTS (\d+)", source_text, re.MULTILINE)
    return int(found.group(1)) if found else 1


def build(source_name: str, defines: dict[str, int], sources: Path = SOURCES) -> Path:
    """The shared library of kernels/cpu/`source_name` with these -D defines, compiled unless cached.
    `sources`: where the kernel sources are (another revision's, for a benchmark's A/B). A source
    that says it is built in parts (`parts`) compiles as that many objects side by side, each with
    -DPART=i, and they link into the one library."""
    source = sources / source_name
    compiler = _compiler()
    flags = [*_base_flags(), *(f"-D{name}={value}" for name, value in defines.items())]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelBuildError(f"{compiler} --version failed: {exc}") from exc
    # What the sources include: the headers, and the sources one library builds from others.
    headers = [path.read_text() for path in sorted([*sources.glob("*.h"), *sources.glob("*.c")])]
    text = source.read_text()
    digest = hashlib.sha256(
        "\0".join([text, *headers, *flags, *_LINK_FLAGS, version, _cpu_identity()]).encode()
    ).hexdigest()[:20]
    directory = cache_dir()
    target = directory / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"cannot create the kernel cache {directory}: {exc}") from exc
    # Compile and link to private names, then rename: concurrent workers never load a half-written file.
    fd, partial = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
    os.close(fd)
    count = parts(text)
    # Said before the compile starts: the longest (the block linear) takes half a minute on 2 cores,
    # once per CPU and compiler, and a first start would otherwise seem to hang.
    log.info("compiling the CPU kernel %s for this CPU, once: it is kept in %s", source.stem, directory)
    started = time.perf_counter()
    objects = [partial.removesuffix(".so") + f".{part}.o" for part in range(count)]
    part_defines = [[f"-DPART={part}"] for part in range(count)] if count > 1 else [[]]
    compiles = [
        [compiler, *flags, *define, "-c", str(source), "-o", obj]
        for define, obj in zip(part_defines, objects, strict=True)
    ]
    try:
        _run_side_by_side(compiles, partial)
        _run_side_by_side([[compiler, *_LINK_FLAGS, *objects, "-o", partial]], partial)
    finally:
        for obj in objects:
            Path(obj).unlink(missing_ok=True)
    os.replace(partial, target)
    log.info("built the CPU kernel %s in %.1f s", target, time.perf_counter() - started)
    return target


def _run_side_by_side(commands: list[list[str]], partial: str) -> None:
    """Runs the commands at once and waits for all; KernelBuildError (and `partial` removed) if any failed."""
    running = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    failures = []
    for command, process in zip(commands, running, strict=True):
        _, stderr = process.communicate()
        if process.returncode != 0:
            failures.append(f"{' '.join(command)} failed:\n{stderr.strip()}")
    if failures:
        Path(partial).unlink(missing_ok=True)
        raise KernelBuildError("\n".join(failures))


def side_by_side(builds: Iterable[Callable[[], T]], threads: int | None = None) -> list[T]:
    """Each build's result, in order, the builds run on `threads` threads (by default one per CPU):
    compiles of different libraries then take a core each (build() is safe to run so). The first
    exception is raised."""
    with ThreadPoolExecutor(max_workers=max(1, threads or os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda build: build(), builds))


def load(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {path}: {exc}") from exc


# What a kernel with two engines multiplies on (kernels/cpu/pair_linear.c, prefill_attention.c).
AMX = "amx"  # AMX tiles
BF16_DOT = "avx512_bf16"  # AVX-512 BF16 dot products


def load_engine(
    source_name: str,
    defines: dict[str, int],
    uses_amx: str,
    allow_amx: bool = True,
    sources: Path = SOURCES,
) -> tuple[ctypes.CDLL, str]:
    """The library of a two-engine kernel, and its engine: AMX where the CPU has it, `allow_amx`
    and Linux grants this process the tile state, else AVX-512 BF16 dot products (the source's
    -DNO_AMX=1 build). `uses_amx` names the library's function that says which it was built for.
    `sources`: as build's."""
    if not cpu_has("avx512_bf16") and not cpu_has("amx_bf16"):
        raise KernelBuildError(f"{source_name} needs AMX-BF16 or AVX-512 BF16, and this CPU has neither")
    library = load(build(source_name, {**defines, "NO_AMX": int(not allow_amx)}, sources))
    if getattr(library, uses_amx)() and library.duoserve_amx_init() != 0:
        # AMX is there but Linux did not grant the tile state: the other engine runs.
        library = load(build(source_name, {**defines, "NO_AMX": 1}, sources))
    return library, AMX if getattr(library, uses_amx)() else BF16_DOT

"""What the worker does between the scheduler's Configure and its own Ready.

It resolves the device and dtype, loads the weights (on the CPU beside the build of the
kernels that multiply on them), sizes the KV cache to the memory and the scheduler's limits,
picks the attention backend, runs one step of each kind through the whole step path so the
first requests pay no start-up cost, and captures the decode CUDA graphs. The process around
it, its sockets and its heartbeat, is gpu_worker/worker.py.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from gpu_worker.attention import CpuPagedAttention, TorchPagedAttention, TritonPagedAttention
from gpu_worker.config import WorkerConfig
from gpu_worker.cuda_graphs import DecodeGraphs, graph_batch_sizes
from gpu_worker.host_memory import return_free_memory
from gpu_worker.kv_cache import KVCache, kv_cache_bytes_per_block
from gpu_worker.linear import (
    BLOCK_MAX_ROWS,
    SMALL_STEP_ROWS,
    block_kernel,
    blocks_take,
    cpu_multiplies_bfloat16,
    packed_linear_available,
    pair_kernel,
    small_steps_take_blocks,
)
from gpu_worker.loader import fill_unread, load_block_weights, load_model
from gpu_worker.model import LlamaModel, blocks_only_weights
from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import ModelRunner
from gpu_worker.streams import CudaStreams
from kernels._launch import dtype_name, interpreting
from kernels.block_weights import BlockWeight
from kernels.cpu_block_linear import BlockLinear
from kernels.cpu_build import AMX
from kernels.cpu_decode import VECTOR_PATHS, KernelBuildError, load_cpu_decode_attention
from kernels.cpu_fused import CpuFusedOps, load_cpu_fused_ops
from kernels.cpu_prefill import load_prefill_attention
from kernels.cpu_stack import CpuDecodeStack, load_cpu_decode_stack
from protos import worker_pb2
from protos.running import RunningEntry, pack_running

log = logging.getLogger(__name__)

DEFAULT_KV_FRACTION = {"cpu": 0.1, "cuda": 0.9}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_multiplies_bfloat16():
            return torch.bfloat16
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise SystemExit("--dtype float16 is supported on CUDA only; use float32 or bfloat16 on the CPU")
    return _DTYPES[name]


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


# --dense-weights auto keeps float32 copies of weights that have blocks while they (and oneDNN's
# packed copies of them) take at most this share of the memory free at start.
DENSE_COPIES_SHARE = 0.25


def choose_blocks_only(
    setting: str,
    dtype: torch.dtype,
    model_config: ModelConfig,
    blocks: dict[str, BlockWeight],
    device: torch.device,
) -> set[str]:
    """The weights to hold as their blocks alone, not read as dense tensors (--dense-weights).
    `keep`: none. `drop`: every weight whose linear can multiply on blocks alone. `auto`: those
    in bfloat16 where the blocks take every step (`blocks_take`: dense copies would go unused;
    where the CPU multiplies bfloat16 they take steps of up to SMALL_STEP_ROWS rows, and the pair-layout and
    oneDNN kernels the others, on the dense copies); in float32
    (where dense copies take steps of more than BLOCK_MAX_ROWS rows, as fast or faster there),
    those too once their float32 copies (and oneDNN's packed ones, where it runs) would take more
    than DENSE_COPIES_SHARE of the memory free now."""
    names = blocks_only_weights(model_config, blocks)
    if setting == "keep" or not names:
        return set()
    if setting == "drop":
        return names
    if dtype != torch.float32:
        return names if blocks_take(dtype, device) else set()
    copies = 2 if packed_linear_available(dtype, device) else 1  # float32, and oneDNN's packing
    dense_bytes = copies * 4 * sum(blocks[name].n * blocks[name].k for name in names)
    free = free_memory_bytes(device)
    if dense_bytes <= DENSE_COPIES_SHARE * free:
        return set()
    log.info(
        "--dense-weights auto: float32 and packed copies of %d weights would take %.0f MB of %.0f MB "
        "free; the blocks take every step instead",
        len(names),
        dense_bytes / 1e6,
        free / 1e6,
    )
    return names


def plan_num_blocks(
    config: WorkerConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    configure: worker_pb2.Configure,
) -> int:
    """KV blocks that fit the memory budget, capped by what the scheduler can use and its --num-kv-blocks."""
    fraction = config.kv_cache_memory or DEFAULT_KV_FRACTION[device.type]
    per_block = kv_cache_bytes_per_block(
        model_config, configure.block_size, dtype, config.kv_cache_dtype == "int8"
    )
    num_blocks = int(free_memory_bytes(device) * fraction) // per_block
    # Every sequence the scheduler may run at once, each at the full context length.
    blocks_per_context = -(-model_config.context_length // configure.block_size)
    num_blocks = min(num_blocks, blocks_per_context * max(configure.max_num_seqs, 1))
    if configure.max_blocks:
        num_blocks = min(num_blocks, configure.max_blocks)
    if num_blocks < 1:
        raise SystemExit(f"--kv-cache-memory {fraction}: not even one KV block of {per_block} bytes fits")
    return num_blocks


def make_attention(
    name: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    vector_bits: int = 512,
    kv_int8: bool = False,
) -> TorchPagedAttention | TritonPagedAttention:
    """The attention backend for `--attention-backend`.

    "auto": Triton kernels on CUDA; on the CPU the C decode kernel when it builds here, else the
    torch path, saying why. "triton" on the CPU needs TRITON_INTERPRET=1 (slow; for tests).
    `vector_bits` (`--cpu-vector-bits`) caps the CPU decode attention's intrinsics path.
    `kv_int8` (`--kv-cache-dtype int8`): the cache is int8 (every backend reads one; the CPU
    kernels are built for it).
    """
    shape = (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda" and not interpreting():
            raise SystemExit(
                "--attention-backend triton needs a CUDA device (or TRITON_INTERPRET=1 for tests)"
            )
        try:
            return TritonPagedAttention(*shape)
        except ImportError as exc:
            raise SystemExit(f"--attention-backend triton: {exc} (pip install triton)") from exc
    if name == "torch" or device.type != "cpu":
        if name == "cpu":
            raise SystemExit(f"--attention-backend cpu runs on the CPU only, not on {device}")
        return TorchPagedAttention(*shape)
    return _cpu_attention(name, model_config, dtype, device, block_size, vector_bits, kv_int8)


def _cpu_attention(
    name: str,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    vector_bits: int,
    kv_int8: bool,
) -> TorchPagedAttention | CpuPagedAttention:
    """The CPU backend: the C decode attention, with as many of the fused ops, the prefill attention
    and the one-call decode stacks as build here; each that does not is logged and left to torch
    (all of them, with `name` "auto", when the decode attention itself does not build)."""
    shape = (model_config.num_heads, model_config.num_kv_heads, model_config.head_dim)
    try:
        kernel = load_cpu_decode_attention(
            model_config.head_dim,
            model_config.num_heads // model_config.num_kv_heads,
            block_size,
            dtype,
            vector_bits,
            kv_int8=kv_int8,
        )
    except KernelBuildError as exc:
        if name == "cpu":
            raise SystemExit(f"--attention-backend cpu: {exc}") from exc
        log.warning("CPU decode kernel unavailable, using the torch attention path: %s", exc)
        return TorchPagedAttention(*shape)
    log.info("CPU decode attention on %s", VECTOR_PATHS[kernel.vector_path])
    try:
        fused: CpuFusedOps | None = load_cpu_fused_ops(dtype)
    except KernelBuildError as exc:
        log.warning("CPU fused ops unavailable, the model runs its unfused torch forward: %s", exc)
        fused = None
    # The kernels that do not wait for the block linear (which the load builds meanwhile) first.
    prefill = None
    try:
        prefill = load_prefill_attention(model_config.head_dim, dtype=dtype)
        log.info("CPU prefill attention multiplies on %s", prefill.engine)
    except KernelBuildError as exc:
        log.info("CPU prefill attention unavailable, prompts take torch's attention: %s", exc)

    def decode_stack(blocks: bool = False, allow_amx: bool = True) -> CpuDecodeStack:
        return load_cpu_decode_stack(
            model_config.head_dim,
            model_config.num_heads // model_config.num_kv_heads,
            block_size,
            allow_amx=allow_amx,
            blocks=blocks,
            vector_bits=vector_bits,
            dtype=dtype if blocks else None,
            kv_int8=kv_int8,
        )

    stack = None
    takes_blocks = blocks_take(dtype, device)
    pair = pair_kernel() if fused is not None and dtype == torch.bfloat16 and not takes_blocks else None
    if fused is not None and takes_blocks and block_kernel(dtype) is not None:
        try:  # for a model whose linears have blocks (--block-linear)
            stack = decode_stack(blocks=True)
        except KernelBuildError as exc:
            log.warning("CPU block decode stack unavailable, decode steps call each op: %s", exc)
    if pair is not None:
        try:  # its pair-layout linear on the model's linears' engine
            stack = decode_stack(allow_amx=pair.engine == AMX)
        except KernelBuildError as exc:
            log.warning("CPU decode stack unavailable, decode steps call each op: %s", exc)
    small_stack = None
    if fused is not None and small_steps_take_blocks(dtype, device):
        kernel_for_blocks = block_kernel(dtype)
        if kernel_for_blocks is not None and kernel_for_blocks.dot_products:
            try:  # small decode steps, on the blocks' dot products
                small_stack = decode_stack(blocks=True)
                log.info(
                    "decode steps of up to %d sequences run on the blocks' dot products", SMALL_STEP_ROWS
                )
            except KernelBuildError as exc:
                log.warning("CPU block decode stack unavailable, small decode steps take the pairs: %s", exc)
    return CpuPagedAttention(
        *shape,
        kernel=kernel,
        fused_ops=fused,
        decode_stack=stack,
        prefill_kernel=prefill,
        small_decode_stack=small_stack,
    )


def warm_up(runner: ModelRunner, block_size: int) -> None:
    """One prefill, two decodes (the second forecast on the CPU, gpu_worker/forecast.py) and a decode
    with a new prompt's chunk behind it, through the whole step path, so the first requests pay no
    start-up cost: each kernel a step of these kinds runs is built, compiled or loaded here. On a
    GPU the mixed step launches the prefill kernel on metadata that starts a row into the step's
    arrays, as serving does. The first sequence samples greedily, as most requests do, and the
    second draws with temperature, top-k and top-p, so both of the sampler's paths run.

    Everything goes to block 0, so even a one-block pool warms up; requests overwrite it later.
    """
    prompt = np.arange(1, block_size, dtype="<i4")  # block_size - 1 tokens, then two decodes

    def whole_prompt(
        seq_id: int, tokens: np.ndarray, sampling: worker_pb2.SamplingParams
    ) -> worker_pb2.NewSequence:
        return worker_pb2.NewSequence(
            seq_id=seq_id,
            sampling=sampling,
            token_ids=tokens.tobytes(),
            prompt_len=len(tokens),
            block_ids=np.zeros(1, dtype="<i4").tobytes(),
            num_new_tokens=len(tokens),
        )

    greedy = worker_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)
    drawn = worker_pb2.SamplingParams(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.0, seed=0)
    runner.run(runner.stage(worker_pb2.Step(step_id=0, new_sequences=[whole_prompt(0, prompt, greedy)])))
    for step_id, new_blocks in ((1, ()), (2, (0,))):  # the second decode starts a block: block 0 again
        running = pack_running([RunningEntry(0, len(prompt) + step_id - 1, 1, new_blocks)])
        staged = runner.stage(worker_pb2.Step(step_id=step_id, running=running))
        runner.forecast(staged)
        runner.run(staged)
    running = pack_running([RunningEntry(0, len(prompt) + 2, 1, ())])
    chunk = whole_prompt(1, prompt[:3], drawn)
    runner.run(runner.stage(worker_pb2.Step(step_id=3, running=running, new_sequences=[chunk])))
    runner.forget_all()


def capture_decode_graphs(
    config: WorkerConfig,
    model: LlamaModel,
    kv_cache: KVCache,
    configure: worker_pb2.Configure,
    streams: CudaStreams | None,
) -> list[DecodeGraphs]:
    """One set of decode graphs per compute stream (they share inputs, so streams cannot share a
    set), when on CUDA with the Triton backend and --cuda-graphs."""
    if model.device.type != "cuda" or not config.cuda_graphs:
        return []
    if model.attention_backend != "triton":
        log.warning(
            "CUDA graphs need the triton attention backend, not %s: decode runs eagerly",
            model.attention_backend,
        )
        return []
    largest = min(config.cuda_graph_max_batch, configure.max_num_seqs or config.cuda_graph_max_batch)
    sizes = graph_batch_sizes(largest)
    sets = [
        DecodeGraphs(model, kv_cache, configure.block_size, model.config.context_length, sizes)
        for _ in range(len(streams.compute) if streams is not None else 1)
    ]
    for graphs in sets:
        graphs.capture()
    return sets


def load_weights(
    config: WorkerConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_build: Future[BlockLinear | None] | None,
) -> LlamaModel:
    """The model with its weights in, its linears on the file's blocks where `block_build` (the
    block linear's library, building meanwhile) gives a kernel. In float32 the kernel also makes
    the dense copies the linears keep: it widens the blocks to the values the file's dequantized
    tensors hold, in a tenth of the time numpy takes to dequantize them."""
    started = time.perf_counter()
    blocks = None
    shape_only: set[str] = set()
    widened: dict[str, torch.Tensor] = {}
    if block_build is not None:  # in bfloat16, 16-bit weights multiply on the model's own copies of them
        blocks = load_block_weights(config.model, model_config, sixteen_bit=dtype != torch.bfloat16)
        shape_only = choose_blocks_only(config.dense_weights, dtype, model_config, blocks, device)
        kernel = block_build.result()
        if kernel is None:  # no kernel after all (said in the log): every linear takes a dense copy
            blocks, shape_only = None, set()
        elif dtype == torch.float32:
            widened = {
                name: kernel.widen(weight) for name, weight in blocks.items() if name not in shape_only
            }
    # In the model's dtype: a bfloat16 state dict takes half the memory of a float32 one.
    model_config, weights = load_model(config.model, shape_only | set(widened), dtype)
    fill_unread(weights, widened, Path(config.model))
    del widened
    model = LlamaModel(model_config, dtype, device, small_batch_linears=config.small_batch_linear)
    released = model.load_weights(weights, blocks, consume=True)
    del weights
    if released:
        return_free_memory()
        log.info("%.0f MB of dense weights released: packed copies of them take their steps", released / 1e6)
    if blocks is not None:
        linears = model.linears()
        types = Counter(lin.blocks.type_name for lin in linears if lin.blocks is not None)
        only = sum(lin.blocks_only for lin in linears)
        log.info(
            "%d of %d linears take the block kernel for steps of %s rows (%s); %d of them hold no "
            "dense copy and take it at every step (--dense-weights %s)",
            model.block_linears,
            len(linears),
            f"up to {BLOCK_MAX_ROWS}"
            if dtype == torch.float32
            else f"up to {SMALL_STEP_ROWS}"
            if small_steps_take_blocks(dtype, device)
            else "any number of",
            ", ".join(f"{count} {name}" for name, count in sorted(types.items())) or "no blocks",
            only,
            config.dense_weights,
        )
    log.info(
        "loaded %s (%s, %s) in %.1f s",
        model_config.name,
        dtype_name(dtype),
        device,
        time.perf_counter() - started,
    )
    return model

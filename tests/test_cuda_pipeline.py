"""The GPU execution path: decode CUDA graphs and the CUDA SBO pipeline against the plain forward.

The pieces that need no GPU (graph sizes, which steps replay, the upload hook) run everywhere;
the rest is gpu-marked and runs in `make gpu-check`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from gpu_worker.batch import ScheduledChunk, build_forward_batch, upload_batch
from gpu_worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, replayable
from gpu_worker.kv_cache import allocate_kv_cache
from gpu_worker.model import LlamaModel
from gpu_worker.model_config import ModelConfig
from gpu_worker.pipeline import StepPipeline
from gpu_worker.runner import ModelRunner, PendingStep, StagedStep
from gpu_worker.startup import make_attention
from gpu_worker.streams import CudaStreams
from tests.worker_steps import (
    TWO_LANES,
    SchedulerScript,
    assert_same_record,
    cpu_runner,
    decode_step,
    drive_with_lookahead,
    pipeline_thread,
    plain_tokens,
    prompt_step,
    save_tiny_llama,
    tokens_of,
    two_lanes_through_pipeline,
)

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 16


def test_graph_batch_sizes_cover_every_batch_up_to_the_largest() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(300) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 256, 300]
    assert graph_batch_sizes(0) == []


def test_only_decode_only_steps_replay() -> None:
    decode = [ScheduledChunk([5], 20, [0, 1], True), ScheduledChunk([6], 3, [2], True)]
    assert replayable(build_forward_batch(decode, BLOCK_SIZE, "cpu"))
    prefill = ScheduledChunk([1, 2, 3], 0, [3], True)
    assert not replayable(build_forward_batch([*decode, prefill], BLOCK_SIZE, "cpu"))
    # A one-token chunk in the middle of a prompt samples nothing: its step runs eagerly.
    middle = ScheduledChunk([7], 4, [4], False)
    assert not replayable(build_forward_batch([*decode, middle], BLOCK_SIZE, "cpu"))


def test_build_forward_batch_sends_every_array_through_the_upload_hook() -> None:
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def upload(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        seen.append((array.shape, dtype))
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)

    chunks = [ScheduledChunk([5], 20, [0, 1], True), ScheduledChunk([1, 2, 3], 16, [2, 3], True)]
    hooked = build_forward_batch(chunks, BLOCK_SIZE, "cpu", upload)
    plain = build_forward_batch(chunks, BLOCK_SIZE, "cpu")
    assert len(seen) == 13  # 7 batch tensors, 4 decode, 2 for the prefill's cached prefix
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "block_tables"):
        assert torch.equal(getattr(hooked, name), getattr(plain, name)), name


def test_a_host_built_batch_goes_to_the_device_whole_through_the_upload_hook() -> None:
    """upload_batch (a forecast taken on a GPU): every tensor of the batch and of its attention
    metadata goes through the hook, with its dtype and values."""
    chunks = [
        ScheduledChunk([5], 20, [0, 1], True),
        ScheduledChunk([9], 3, [4], True),
        ScheduledChunk([1, 2, 3], 16, [2, 3], False),  # a window behind a cached prefix
        ScheduledChunk([4, 5], 0, [5], True),  # a whole prompt: no key slots, no mask
    ]
    host = build_forward_batch(chunks, BLOCK_SIZE, "cpu")
    seen: list[int] = []

    def upload(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        seen.append(array.size)
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype).clone()

    moved = upload_batch(host, "cpu", upload)
    assert len(seen) == 13  # 7 batch tensors, 4 decode, 2 for the window's cached prefix
    assert moved.decode is not None and moved.decode.num_seqs == 2
    window, prompt = moved.prefills
    assert window.key_slots is not None and window.mask is not None
    assert prompt.key_slots is None and prompt.mask is None

    def copied(ours: torch.Tensor, theirs: torch.Tensor) -> bool:  # a copy, as a device's would be
        return (
            ours.dtype == theirs.dtype and torch.equal(ours, theirs) and ours.data_ptr() != theirs.data_ptr()
        )

    assert_same_record(moved, host, "batch", copied)


@pytest.mark.parametrize("one_thread", [True, False])
def test_the_sbo_pipeline_serves_two_lanes_as_the_plain_runner_would(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], one_thread: bool
) -> None:
    """The pipeline's loops on the CPU: one thread (CUDA's SBO loop; here every reply is ready at
    once) and the staging thread, each driven like DBO, give the plain runner's tokens and answer
    a bad step with an error."""
    expected = generate_on_two_lanes(cpu_runner(tiny, "torch", BLOCK_SIZE), overlap=False)
    runner = cpu_runner(tiny, "torch", BLOCK_SIZE)
    tokens, results = two_lanes_through_pipeline(
        lambda socket: StepPipeline(socket, runner, sbo=True, one_thread=one_thread), 12, vocab_size=512
    )
    assert tokens == expected
    assert len(results) == 2 * 13
    assert all(r.staging_seconds > 0 and 0 <= r.exposed_staging_seconds <= r.staging_seconds for r in results)
    # Both loops forecast each lane's next step while one computes (every prompt ended, so every
    # step's sequences sample): all 24 decode steps come from forecasts. (On a GPU the one-thread
    # loop forecasts only steps that leave a prompt unfinished: see the gpu tests below.)
    by_step = sorted(results, key=lambda r: r.step_id)
    assert [r.forecast for r in by_step] == [False] * 2 + [True] * 24


# ---------------------------------------------------------------------------------------------
# On a GPU (make gpu-check)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-cuda"),
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        max_position_embeddings=1024,
    )


def cuda_model(tiny: tuple[ModelConfig, dict[str, torch.Tensor]]) -> tuple[LlamaModel, list]:
    assert torch.cuda.is_available(), "the gpu subset runs on a machine with a CUDA device (make gpu-check)"
    torch.backends.cuda.matmul.allow_tf32 = False
    config, weights = tiny
    device = torch.device("cuda")
    model = LlamaModel(config, torch.float32, device)
    model.load_weights(weights)
    model.use_attention(make_attention("triton", config, torch.float32, device, BLOCK_SIZE))
    return model, allocate_kv_cache(config, 256, BLOCK_SIZE, torch.float32, device)


@pytest.mark.gpu
def test_decode_graph_replays_compute_what_the_eager_forward_computes(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    model, kv_cache = cuda_model(tiny)
    # Random K/V in the cache stands for the sequences' prefixes.
    for k_cache, v_cache in kv_cache:
        k_cache.normal_()
        v_cache.normal_()
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, tiny[0].context_length, [1, 2, 4, 8])
    graphs.capture()
    gen = torch.Generator().manual_seed(0)
    for num in (1, 3, 8, 2):
        contexts = torch.randint(1, 300, (num,), generator=gen).tolist()
        chunks = []
        for row, context in enumerate(contexts):
            blocks = list(range(row * 20, row * 20 + 20))
            chunks.append(
                ScheduledChunk([int(torch.randint(3, 500, (1,), generator=gen))], context, blocks, True)
            )
        batch = build_forward_batch(chunks, BLOCK_SIZE, "cuda")
        size = graphs.size_for(batch)
        assert size is not None and size >= num and size == min(s for s in graphs.sizes if s >= num)
        replayed = graphs.run(batch, size).clone()
        eager = model(batch, kv_cache)
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    assert graphs.replays == 4


def generate_on_two_lanes(runner: ModelRunner, overlap: bool) -> dict[int, list[int]]:
    """Lane 0 runs sequences 1-3, lane 1 sequences 4-5; 12 decode steps each. With `overlap`, each
    lane's step is launched before the other lane's tokens are read back (DBO on two streams)."""
    lanes = TWO_LANES
    out: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    step_id = 0
    staged = {}
    for lane, seqs in lanes.items():
        staged[lane] = runner.stage(prompt_step(step_id := step_id + 1, seqs, lane=lane, vocab_size=512))
        for seq_id, length, _ in seqs:
            computed[seq_id] = length
    for _ in range(13):
        results = {}
        if overlap:
            pending = {lane: runner.execute(staged[lane]) for lane in lanes}
            results = {lane: runner.finish(pending[lane]) for lane in lanes}
        else:
            results = {lane: runner.run(staged[lane]) for lane in lanes}
        for lane in lanes:
            for seq_id, token in tokens_of(results[lane]).items():
                out.setdefault(seq_id, []).append(token)
            mine = {seq_id: computed[seq_id] for seq_id, _, _ in lanes[lane]}
            staged[lane] = runner.stage(decode_step(step_id := step_id + 1, lane, mine))
            for seq_id in mine:
                computed[seq_id] += 1
    return out


@pytest.mark.gpu
def test_cuda_sbo_streams_and_graphs_generate_what_the_plain_runner_generates(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    model, kv_cache = cuda_model(tiny)
    device = torch.device("cuda")
    plain = ModelRunner(model, kv_cache, BLOCK_SIZE, device)
    expected = generate_on_two_lanes(plain, overlap=False)
    streams = CudaStreams(device, compute_streams=2)
    graph_sets = [
        DecodeGraphs(model, kv_cache, BLOCK_SIZE, tiny[0].context_length, [1, 2, 4]) for _ in range(2)
    ]
    for graphs in graph_sets:
        graphs.capture()
    overlapped = ModelRunner(model, kv_cache, BLOCK_SIZE, device, streams=streams, graphs=graph_sets)
    assert generate_on_two_lanes(overlapped, overlap=True) == expected
    assert all(graphs.replays == 12 for graphs in graph_sets)  # every decode step of both lanes


class BusyDevice(ModelRunner):
    """A real CUDA runner that gives its compute stream a few milliseconds of matrix multiplies
    before each step's work, so the next step is surely staged while the device still computes."""

    busy_input: torch.Tensor
    busy: list[tuple[torch.cuda.Event, torch.cuda.Event]]  # each busy stretch's begin and end

    def execute(self, staged: StagedStep, yield_point: Callable[[], None] | None = None) -> PendingStep:
        if self.streams is not None and staged.batch is not None:
            stream = self.streams.for_lane(staged.lane)
            with torch.cuda.stream(stream):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record(stream)
                for _ in range(4):
                    torch.mm(self.busy_input, self.busy_input)
                end.record(stream)
            self.busy.append((begin, end))
        return super().execute(staged, yield_point)


@pytest.mark.gpu
def test_one_thread_cuda_sbo_serves_two_lanes_as_the_plain_runner_would(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """The whole CUDA SBO loop in one thread (the worker's default with --sbo on CUDA): inputs on
    the data stream, both lanes on one compute stream with graphs, replies made as the tokens land.
    One stream queues each lane's step behind the other's, so every step after the first is
    staged while the other lane's still runs, and that staging is reported hidden."""
    model, kv_cache = cuda_model(tiny)
    device = torch.device("cuda")
    expected = generate_on_two_lanes(ModelRunner(model, kv_cache, BLOCK_SIZE, device), overlap=False)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, tiny[0].context_length, [1, 2, 4])
    graphs.capture()
    runner = BusyDevice(
        model, kv_cache, BLOCK_SIZE, device, streams=CudaStreams(device, compute_streams=1), graphs=[graphs]
    )
    runner.busy_input = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()  # the compute stream reads it
    runner.busy = []
    tokens, results = two_lanes_through_pipeline(
        lambda socket: StepPipeline(socket, runner, sbo=True, one_thread=True), 12, vocab_size=512
    )
    assert tokens == expected
    assert graphs.replays == 24  # every decode step of both lanes
    assert all(r.compute_seconds > 0 for r in results)  # GPU time from the step's events
    # The sampler's, from an event between the forward and the sampler to the step's last.
    assert all(0 < r.sampling_seconds <= r.compute_seconds for r in results if r.seq_ids)
    exposed = [r for r in results if r.exposed_staging_seconds > 0]
    torch.cuda.synchronize()
    assert len(exposed) <= 2, (
        f"busy stretches {[begin.elapsed_time(end) for begin, end in runner.busy[:4]]} ms; "
        "step, staging, exposed: "
        f"{[(r.step_id, r.staging_seconds, r.exposed_staging_seconds) for r in results[:8]]}"
    )


@pytest.mark.gpu
def test_one_thread_cuda_sbo_takes_lookahead_steps_as_the_plain_runner_would(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """The scheduler sends each decode while the step in front computes (lookahead, which CUDA SBO
    in one thread takes): its input is the token that step samples. The pipeline answers the step
    in front, writes the token into the uploaded inputs on the compute stream and replays the
    decode graph: greedy tokens are the plain runner's."""
    model, kv_cache = cuda_model(tiny)
    device = torch.device("cuda")
    expected = plain_tokens(ModelRunner(model, kv_cache, BLOCK_SIZE, device), decodes=12)
    graphs = DecodeGraphs(model, kv_cache, BLOCK_SIZE, tiny[0].context_length, [1, 2, 4, 8])
    graphs.capture()
    runner = BusyDevice(  # each step a few milliseconds: the next one surely arrives meanwhile
        model, kv_cache, BLOCK_SIZE, device, streams=CudaStreams(device, compute_streams=1), graphs=[graphs]
    )
    runner.busy_input = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()  # the compute stream reads it
    runner.busy = []
    late_steps = []
    execute = runner.execute

    def launch(staged: StagedStep, yield_point: object = None) -> PendingStep:
        if staged.late is not None:
            late_steps.append(staged.step_id)
        return execute(staged, yield_point)  # type: ignore[arg-type]

    runner.execute = launch  # type: ignore[method-assign]
    with pipeline_thread(
        lambda socket: StepPipeline(socket, runner, sbo=True, one_thread=True)
    ) as scheduler_side:
        tokens, results = drive_with_lookahead(scheduler_side, decodes=12)
    assert tokens == expected and len(results) == 13
    assert graphs.replays == 12  # every decode step
    assert len(late_steps) >= 10, f"only steps {late_steps} arrived before the step in front was answered"


def windows_then_decodes(runner: ModelRunner, plain: ModelRunner, block_size: int) -> list[bool]:
    """A 100-token prompt in windows of 32 (32, 32, 32, 4), then three decodes, on `runner` as the
    one-thread SBO loop runs it (forecast right after each launch, reply once the tokens land) and
    on `plain` in lockstep: every step's tokens must agree. Which steps came from forecasts."""
    script = SchedulerScript(block_size)
    steps = [script.prompt_step({7: 100}, chunk=32)]
    forecast = []
    for index in range(7):
        if index:
            seq = script.seqs[7]
            steps.append(
                script.step([script.window(7, min(32, 100 - seq.computed))])
                if seq.computed < 100
                else script.step(script.decode_entries([7]))
            )
        staged = runner.stage(steps[-1])
        pending = runner.execute(staged)
        runner.forecast(staged)  # while the device computes the step
        result = runner.finish(pending)
        expected = plain.run(plain.stage(steps[-1]))
        assert tokens_of(result) == tokens_of(expected), index
        script.take_tokens(result)
        forecast.append(staged.forecast)
    return forecast


@pytest.mark.gpu
def test_cuda_sbo_takes_a_long_prompts_next_window_from_the_host_forecast(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """The next window of a lone long prompt is built on the host while the current one computes,
    and taken (copied on the data stream) when the scheduler sends it; decodes are staged on
    arrival. Greedy tokens are the plain runner's."""
    model, _ = cuda_model(tiny)
    device = torch.device("cuda")

    def runner(**kwargs: object) -> ModelRunner:
        kv = allocate_kv_cache(tiny[0], 256, BLOCK_SIZE, torch.float32, device)
        return ModelRunner(model, kv, BLOCK_SIZE, device, **kwargs)  # type: ignore[arg-type]

    sbo = runner(streams=CudaStreams(device, compute_streams=1))
    assert windows_then_decodes(sbo, runner(), BLOCK_SIZE) == [False, True, True, True, False, False, False]

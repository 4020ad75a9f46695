"""Urgent steps on a real (tiny) model: run inside another step at a block boundary, same tokens."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import pytest
import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.pipeline import StepPipeline
from gpu_worker.runner import ModelRunner, PendingStep, StagedStep
from protos import worker_pb2
from tests.worker_steps import (
    cpu_runner,
    pipeline_thread,
    prompt_step,
    save_tiny_llama,
    tokens_of,
    two_lanes_through_pipeline,
)

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# Step A: three long prompts (the step that gets interrupted); step U: one short prompt (urgent).
STEP_A = [(1, 60, list(range(0, 8))), (2, 33, list(range(8, 13))), (3, 17, list(range(13, 16)))]
STEP_U = [(4, 11, [20, 21])]


def sequential_reference(tiny: tuple[ModelConfig, dict[str, torch.Tensor]], backend: str) -> dict[int, int]:
    runner = cpu_runner(tiny, backend, BLOCK_SIZE)
    first = runner.run(runner.stage(prompt_step(1, STEP_A)))
    second = runner.run(runner.stage(prompt_step(2, STEP_U, urgent=True)))
    return tokens_of(first) | tokens_of(second)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_step_interrupted_at_every_block_boundary_computes_the_same_tokens(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], backend: str
) -> None:
    expected = sequential_reference(tiny, backend)
    runner = cpu_runner(tiny, backend, BLOCK_SIZE)
    outer = runner.stage(prompt_step(1, STEP_A))
    # An urgent step at each boundary of the outer one: 3 layers x 2 blocks, or after each of the
    # 3 layers on the fused path.
    boundaries = tiny[0].num_layers * (1 if runner.model.fused_ops is not None else 2)
    urgent_steps: list[StagedStep] = []
    for index in range(boundaries):
        seq_id = 10 + index
        urgent_steps.append(
            runner.stage(prompt_step(2 + index, [(seq_id, 5 + index, [30 + 2 * index, 31 + 2 * index])]))
        )
    urgent_results: list[worker_pb2.StepResult] = []

    def run_one_urgent_step() -> None:
        urgent_results.append(runner.run(urgent_steps[len(urgent_results)]))

    got = tokens_of(runner.finish(runner.execute(outer, run_one_urgent_step)))
    assert len(urgent_results) == boundaries
    assert got == {k: v for k, v in expected.items() if k in got}
    # Each urgent prompt alone, on a fresh runner, gives the token it got inside the outer step.
    for index, result in enumerate(urgent_results):
        alone = cpu_runner(tiny, backend, BLOCK_SIZE)
        staged = alone.stage(prompt_step(1, [(10 + index, 5 + index, [30 + 2 * index, 31 + 2 * index])]))
        assert tokens_of(result) == tokens_of(alone.run(staged))


class SlowBoundaries(ModelRunner):
    """A real runner whose block boundaries each take 50 ms longer, so an urgent step surely arrives mid-step."""

    def execute(self, staged: StagedStep, yield_point: Callable[[], None] | None = None) -> PendingStep:
        if yield_point is None:
            return super().execute(staged)
        inner = yield_point

        def slow() -> None:
            time.sleep(0.05)
            inner()

        return super().execute(staged, slow)


def test_the_pipeline_answers_an_urgent_step_before_the_step_it_interrupts(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    expected = sequential_reference(tiny, "torch")
    plain = cpu_runner(tiny, "torch", BLOCK_SIZE)
    runner = SlowBoundaries(plain.model, plain.kv_cache, BLOCK_SIZE, plain.device)
    with pipeline_thread(lambda socket: StepPipeline(socket, runner, sbo=True)) as scheduler_side:
        started = time.perf_counter()
        scheduler_side.send(worker_pb2.SchedulerMessage(step=prompt_step(1, STEP_A)).SerializeToString())
        time.sleep(0.08)  # step 1 is at its second boundary or so: 6 boundaries of 50 ms each
        urgent = prompt_step(2, STEP_U, urgent=True)
        scheduler_side.send(worker_pb2.SchedulerMessage(step=urgent).SerializeToString())
        assert scheduler_side.poll(10_000)
        results = [worker_pb2.WorkerMessage.FromString(scheduler_side.recv()).result]
        assert scheduler_side.poll(10_000)
        results.append(worker_pb2.WorkerMessage.FromString(scheduler_side.recv()).result)
        wall = time.perf_counter() - started
        assert [r.step_id for r in results] == [2, 1]
        assert tokens_of(results[0]) | tokens_of(results[1]) == expected
        # The interrupted step's compute time leaves out the urgent step it ran.
        assert results[1].compute_seconds + results[0].compute_seconds <= wall
        assert results[0].wait_seconds == 0 and results[0].exposed_staging_seconds == 0


class RecordsSwitchInterval(ModelRunner):
    """A real runner that notes Python's thread switch interval each time it executes a step."""

    seen: list[float]

    def execute(self, staged: StagedStep, yield_point: Callable[[], None] | None = None) -> PendingStep:
        self.seen.append(sys.getswitchinterval())
        return super().execute(staged, yield_point)


@pytest.mark.parametrize("sbo", [True, False])
def test_sbo_runs_its_threads_with_the_configured_switch_interval_and_restores_it(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], sbo: bool
) -> None:
    plain = cpu_runner(tiny, "torch", 16)  # the block size TWO_LANES' tables are for
    runner = RecordsSwitchInterval(plain.model, plain.kv_cache, 16, plain.device)
    runner.seen = []
    before = sys.getswitchinterval()
    two_lanes_through_pipeline(
        lambda socket: StepPipeline(socket, runner, sbo=sbo, switch_interval=0.0003), 2, vocab_size=256
    )
    # Only SBO runs threads that hand the interpreter lock to one another.
    assert runner.seen == [pytest.approx(0.0003 if sbo else before)] * 6
    assert sys.getswitchinterval() == before


def test_two_sbo_pipelines_in_one_process_each_answer_over_their_own_results_socket(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    # One pipeline keeps running (its results socket bound) while a second one serves two lanes.
    first = cpu_runner(tiny, "torch", 16)
    with pipeline_thread(lambda socket: StepPipeline(socket, first, sbo=True)) as scheduler_side:
        tokens, _ = two_lanes_through_pipeline(
            lambda socket: StepPipeline(socket, cpu_runner(tiny, "torch", 16), sbo=True), 2, vocab_size=256
        )
        assert len(tokens) == 5 and all(len(seq) == 3 for seq in tokens.values())  # a prompt token, 2 decodes
        scheduler_side.send(worker_pb2.SchedulerMessage(step=prompt_step(1, STEP_U)).SerializeToString())
        assert scheduler_side.poll(30_000), "the first pipeline stopped answering"
        message = worker_pb2.WorkerMessage.FromString(scheduler_side.recv())
        alone = cpu_runner(tiny, "torch", 16)
        assert tokens_of(message.result) == tokens_of(alone.run(alone.stage(prompt_step(1, STEP_U))))


def test_queueing_an_urgent_step_sets_the_flag_its_yield_point_clears_before_running_it() -> None:
    from gpu_worker.pipeline import _Staged, _StepQueue, _UrgentSteps

    def staged(step_id: int, urgent: bool) -> _Staged:
        return _Staged(StagedStep(step_id=step_id, lane=0, batch=None, sampled=[], urgent=urgent), 0.0)

    queue = _StepQueue()
    ran: list[int] = []
    boundary = _UrgentSteps(queue, lambda item: ran.append(item.staged.step_id if item.staged else -1))
    queue.put(staged(1, urgent=False))
    assert boundary.pending.value == 0  # an ordinary step does not stop a step in progress
    queue.put(staged(2, urgent=True))
    queue.put(staged(3, urgent=True))
    assert boundary.pending.value == 1
    boundary()
    assert ran == [2, 3] and boundary.pending.value == 0
    boundary()  # nothing pending: nothing runs
    assert ran == [2, 3]
    assert queue.get().staged.step_id == 1  # type: ignore[union-attr]

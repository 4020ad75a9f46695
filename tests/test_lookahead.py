"""Lookahead steps on the worker: a step staged before the step in front of it has run.

With lookahead (scheduler/planner.py) the scheduler sends a sequence's next step while its current
one computes, so the staging thread stages it before the token it decodes is sampled. Those inputs
are late inputs, written in just before the forward. Here a runner takes every step that way and
a plain runner takes each step only after running the one before; both must compute the same
batches and the same tokens, through every way of staging (in full, and each forecast path).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest
import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.pipeline import StepPipeline
from gpu_worker.runner import ModelRunner, PendingStep, StagedStep, StepError
from protos import worker_pb2
from protos.running import RunningEntry
from tests.worker_steps import (
    SchedulerScript,
    assert_same_record,
    cpu_runner,
    drive_with_lookahead,
    pipeline_thread,
    plain_tokens,
    save_tiny_llama,
    tokens_of,
)

pytest.importorskip("transformers")

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


class AheadAndPlain:
    """`ahead` stages each step as soon as it is sent, one step ahead of the one it runs, and
    forecasts after it as SBO's staging thread does; `plain` stages each step when it runs it."""

    def __init__(self, tiny: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
        self.ahead = cpu_runner(tiny, "cpu", BLOCK_SIZE)
        self.plain = cpu_runner(tiny, "cpu", BLOCK_SIZE)
        self.script = SchedulerScript(BLOCK_SIZE)
        self.in_flight: deque[tuple[worker_pb2.Step, StagedStep]] = deque()

    def send(self, step: worker_pb2.Step) -> StagedStep:
        staged = self.ahead.stage(step)
        self.ahead.forecast(staged)
        self.in_flight.append((step, staged))
        return staged

    def answer(self) -> None:
        """The oldest step in flight runs on both runners: the same batch, the same tokens."""
        step, staged = self.in_flight.popleft()
        result = self.ahead.run(staged)  # writes its late inputs in first
        plain = self.plain.stage(step)
        expected = self.plain.run(plain)
        assert staged.batch is not None and plain.batch is not None
        assert_same_record(staged.batch, plain.batch, f"step {step.step_id}")
        assert tokens_of(result) == tokens_of(expected)
        self.script.take_tokens(result)


def test_steps_staged_before_the_step_in_front_runs_compute_what_the_plain_runner_does(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = AheadAndPlain(tiny)
    script = both.script
    both.send(script.prompt_step({1: 5, 2: 8, 3: 13}))
    # A newcomer beside the lookahead decodes: staged in full, the decodes' inputs left late.
    joined = both.send(script.prompt_step({4: 6}, running=script.decode_entries([1, 2, 3], ahead=1)))
    assert not joined.forecast and joined.late is not None and len(joined.late.rows) == 3
    both.answer()
    # The step in flight has 4 first (new sequences first); the scheduler sends admission order:
    # the forecast's rows are selected, and their inputs are late.
    selected = both.send(script.step(script.decode_entries([1, 2, 3, 4], ahead=1)))
    assert selected.forecast and selected.late is not None and len(selected.late.rows) == 4
    both.answer()
    for _ in range(6):  # decode-only and exact: the inputs are the token buffer the step fills
        exact = both.send(script.step(script.decode_entries([1, 2, 3, 4], ahead=1)))
        assert exact.forecast and exact.late is None
        both.answer()
    # Sequence 1 released: selected again.
    entries = script.decode_entries([2, 3, 4], ahead=1)
    released = both.send(script.step(entries, released_seq_ids=np.asarray([1], dtype="<u8").tobytes()))
    assert released.forecast and released.late is not None
    both.answer()
    # A long prompt in windows of 12 beside the decodes: the window forecasts' decode rows are late.
    both.send(script.prompt_step({5: 30}, chunk=12, running=script.decode_entries([2, 3, 4], ahead=1)))
    both.answer()
    window = both.send(script.step([*script.decode_entries([2, 3, 4], ahead=1), script.window(5, 12)]))
    assert window.forecast and window.late is not None and window.late.rows == [0, 1, 2]
    while both.in_flight:
        both.answer()
    assert both.ahead.seqs[3].token_ids == both.plain.seqs[3].token_ids
    assert both.ahead.seqs[5].num_computed == both.plain.seqs[5].num_computed == 24


def test_a_runner_off_the_host_leaves_a_late_input_for_execute() -> None:
    """On a GPU the batch is uploaded while it is staged: the late row stays a placeholder there,
    and execute writes the token in once the step in front has appended it (ready)."""
    off_host = ModelRunner(None, None, BLOCK_SIZE, torch.device("meta"))  # type: ignore[arg-type]
    script = SchedulerScript(BLOCK_SIZE)
    off_host.stage(script.prompt_step({1: 5}))
    staged = off_host.stage(script.step(script.decode_entries([1], ahead=1)))
    assert staged.batch is not None and staged.batch.input_ids.device.type == "meta"
    assert staged.late is not None and (staged.late.rows, staged.late.positions) == ([0], [5])
    assert not staged.late.ready()
    off_host.seqs[1].token_ids.append(7)  # what finish does with the step in front's token
    assert staged.late.ready()


def test_a_step_past_the_tokens_known_and_sampled_is_refused(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    runner = cpu_runner(tiny, "cpu", BLOCK_SIZE)
    script = SchedulerScript(BLOCK_SIZE)
    runner.stage(script.prompt_step({1: 5}))
    with pytest.raises(StepError, match=r"sequence 1 asks for tokens 5\.\.7 of 6"):
        runner.stage(script.step([RunningEntry(1, 5, 2, [])]))


# ---------------------------------------------------------------------------------------------
# Through a real pipeline on a socket


@pytest.mark.parametrize("sbo", [True, False])
def test_the_pipeline_serves_a_lane_that_keeps_two_steps_in_flight(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], sbo: bool
) -> None:
    """Each decode sent before the step in front is answered: with SBO the staging thread stages
    it on arrival, from the forecast; without SBO it waits in the socket until the one in front is
    done, and is staged in full. The tokens are the plain runner's either way."""
    expected = plain_tokens(cpu_runner(tiny, "cpu", 16), decodes=12)
    runner = cpu_runner(tiny, "cpu", 16)
    with pipeline_thread(lambda socket: StepPipeline(socket, runner, sbo=sbo)) as scheduler_side:
        tokens, results = drive_with_lookahead(scheduler_side, decodes=12)
    assert tokens == expected and len(results) == 13
    assert all(0 < r.sampling_seconds < r.compute_seconds for r in results)  # every step sampled
    decodes = sorted(results, key=lambda r: r.step_id)[1:]
    if sbo:
        assert all(r.forecast for r in decodes)
    else:
        assert not any(r.forecast for r in decodes)
        assert all(r.exposed_staging_seconds == r.staging_seconds for r in decodes)


class _TokensOnTheirWay:
    """A CUDA event's stand-in on the CPU: the step's tokens count as on their way back for a while
    after its launch, or until someone waits for them."""

    def __init__(self, seconds: float) -> None:
        self.at = time.perf_counter() + seconds

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        self.at = min(self.at, time.perf_counter())

    def elapsed_time(self, _end: object) -> float:
        return 0.0


def test_one_thread_sbo_answers_the_steps_in_front_before_it_launches_a_lookahead_step(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """CUDA SBO in one thread, on the CPU: each step's tokens are 'on their way' for 50 ms after it
    is launched, as on a GPU whose copy back has not landed. A lookahead step arrives meanwhile,
    its input the token the step in front samples: the pipeline answers that step first, then
    writes the input in and launches. Decode steps are not forecast, as on a GPU."""
    expected = plain_tokens(cpu_runner(tiny, "cpu", 16), decodes=12)
    runner = cpu_runner(tiny, "cpu", 16)
    runner.forecast = lambda staged: None  # type: ignore[method-assign]
    execute = runner.execute
    late_steps = []

    def launch(staged: StagedStep, yield_point: object = None) -> PendingStep:
        if staged.late is not None:
            late_steps.append(staged.step_id)
        pending = execute(staged, yield_point)  # type: ignore[arg-type]
        pending.started = pending.done = _TokensOnTheirWay(0.05)  # type: ignore[assignment]
        return pending

    runner.execute = launch  # type: ignore[method-assign]
    pipeline = lambda socket: StepPipeline(socket, runner, sbo=True, one_thread=True)  # noqa: E731
    with pipeline_thread(pipeline) as scheduler_side:
        tokens, results = drive_with_lookahead(scheduler_side, decodes=12)
    assert tokens == expected and len(results) == 13
    assert len(late_steps) >= 10, f"only steps {late_steps} took a late input"

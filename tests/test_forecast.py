"""The decode forecast (gpu_worker/forecast.py): a step taken from it is the step staged in full.

Two runners of the tiny model go through the same steps in lockstep: one stages every step in
full, the other builds a forecast after staging each step, as SBO's staging thread does. Blocks of
8 tokens make decodes cross block boundaries, where the scheduler adds a block the forecast could
not know.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from gpu_worker import runner as runner_module
from gpu_worker.batch import ForwardBatch
from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import ModelRunner, StagedStep, StepError
from protos import worker_pb2
from protos.running import RunningEntry, pack_running
from tests.worker_steps import SchedulerScript, assert_same_record, cpu_runner, save_tiny_llama, tokens_of

pytest.importorskip("transformers")

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def assert_same_batch(forecast: ForwardBatch | None, full: ForwardBatch | None) -> None:
    assert forecast is not None and full is not None
    assert_same_record(forecast, full, "batch")


def as_executed(staged: StagedStep) -> ForwardBatch | None:
    """The staged batch as `execute` runs it: with its late inputs written in (the step in front
    has finished; `execute` writes the same values again)."""
    if staged.late is not None and staged.batch is not None:
        staged.late.write(staged.batch.input_ids)
    return staged.batch


class Lockstep:
    """Runs each step on a forecasting runner and a plain one; checks they agree."""

    def __init__(self, tiny: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
        self.forecasting = cpu_runner(tiny, "cpu", BLOCK_SIZE)
        self.plain = cpu_runner(tiny, "cpu", BLOCK_SIZE)
        self.script = SchedulerScript(BLOCK_SIZE)
        self.last_order: list[int] = []  # the sequences the last step sampled, in order
        self.last_lane = 0

    def stage(self, step: worker_pb2.Step) -> tuple[StagedStep, StagedStep]:
        staged = self.forecasting.stage(step)
        self.forecasting.forecast(staged)
        # No forecast outlives the sequence it is filed under.
        assert self.forecasting.forecasts.filed_under() <= set(self.forecasting.seqs)
        return staged, self.plain.stage(step)

    def run(self, step: worker_pb2.Step) -> bool:
        """Both runners run `step`: same batch, same tokens. True when it came from the forecast."""
        staged, plain = self.stage(step)
        if staged.batch is not None and staged.forecast:
            assert_same_batch(as_executed(staged), as_executed(plain))
        assert [s.seq_id for s in staged.sampled] == [s.seq_id for s in plain.sampled]
        result = self.forecasting.run(staged)
        expected = self.plain.run(plain)
        assert tokens_of(result) == tokens_of(expected)
        self.script.take_tokens(result)
        self.last_order = [s.seq_id for s in staged.sampled]
        self.last_lane = step.lane
        return staged.forecast

    def decode(self, seq_ids: list[int], lane: int = 0) -> bool:
        return self.run(self.script.step(self.script.decode_entries(seq_ids), lane=lane))


def test_decode_steps_come_from_the_forecast_across_block_boundaries(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = Lockstep(tiny)
    assert not both.run(both.script.prompt_step({1: 5, 2: 8, 3: 13}))
    assert both.decode([1, 2, 3])  # each prompt ended in that step, and sampled: forecast
    added = 0
    for i in range(20):
        entries = both.script.decode_entries([1, 2, 3])
        added += sum(len(e.new_block_ids) for e in entries)
        # Either lane: the scheduler sends a sequence's next step on whichever is free.
        assert both.run(both.script.step(entries, lane=i % 3 // 2))
    assert added >= 6  # every sequence started blocks the forecast had to take from the step
    # The third sequence grew from 2 to 5 blocks: the tables widened under the forecast too.
    assert len(both.forecasting.seqs[3].block_table) == 5 == len(both.script.seqs[3].blocks)
    assert both.forecasting.seqs[3].block_table == both.plain.seqs[3].block_table


def released(script: SchedulerScript) -> worker_pb2.Step:
    # The first: the forecast filed under it must go with it.
    entries = script.decode_entries([2, 3])
    return script.step(entries, released_seq_ids=np.asarray([1], dtype="<u8").tobytes())


def joined(script: SchedulerScript) -> worker_pb2.Step:
    return script.prompt_step({4: 6}, running=script.decode_entries([1, 2, 3]))


def reordered(script: SchedulerScript) -> worker_pb2.Step:
    # Sequences 2 and 3 are at the same position: only their ids tell the orders apart.
    return script.step(script.decode_entries([1, 3, 2]))


def block_ahead(script: SchedulerScript) -> worker_pb2.Step:
    entries = script.decode_entries([1, 2, 3])
    early = next(e for e in entries if not e.new_block_ids)
    entries[entries.index(early)] = RunningEntry(
        early.seq_id, early.num_computed_tokens, 1, script.blocks_for(1)
    )
    return script.step(entries)


def split(script: SchedulerScript) -> worker_pb2.Step:
    return script.step(script.decode_entries([2, 3]), lane=1)


def urgent(script: SchedulerScript) -> worker_pb2.Step:
    return script.step(script.decode_entries([1, 2, 3]), urgent=True)


def start_three(tiny: tuple[ModelConfig, dict[str, torch.Tensor]]) -> Lockstep:
    both = Lockstep(tiny)
    both.run(both.script.prompt_step({1: 5, 2: 8, 3: 8}))
    for _ in range(3):
        assert both.decode([1, 2, 3])
    return both


@pytest.mark.parametrize("next_step", [released, reordered, split])
def test_a_step_running_some_of_the_forecast_sequences_takes_their_rows(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], next_step: Callable[[SchedulerScript], worker_pb2.Step]
) -> None:
    both = start_three(tiny)
    assert both.run(next_step(both.script))  # the batch checked against the full staging's
    if next_step is split:
        # Sequence 1 sat out: the forecast of 2 and 3 cannot serve a step that starts with it.
        assert not both.decode([1, 2, 3])
    order = sorted(both.forecasting.seqs)
    assert both.decode(order)
    assert both.decode(order)


@pytest.mark.parametrize("next_step", [joined, block_ahead, urgent])
def test_a_step_the_forecast_cannot_serve_is_staged_in_full(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], next_step: Callable[[SchedulerScript], worker_pb2.Step]
) -> None:
    both = start_three(tiny)
    assert not both.run(next_step(both.script))
    # Every sequence sampled in that step (4's whole prompt too): its successor is forecast, in
    # the scheduler's order (admission order), not the step's (new sequences first).
    assert both.decode(sorted(both.forecasting.seqs))


def test_a_long_prompt_goes_on_window_after_window_from_the_forecast(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    """Windows of 12 tokens over blocks of 8: each starts one or two blocks the forecast leaves to
    the scheduler, in its tokens' slots and in the key slots of its cached prefix."""
    both = Lockstep(tiny)
    script = both.script
    both.run(script.prompt_step({1: 5, 2: 9}))
    # Sequence 3's first window comes with 1 and 2's decodes, as the scheduler sends it (a new
    # sequence: staged in full).
    assert not both.run(script.prompt_step({3: 41}, chunk=12, running=script.decode_entries([1, 2])))
    # Then decodes first, the window after them (the planner's order): 12, 12, then the last 5.
    for length in (12, 12, 5):
        assert both.run(script.step([*script.decode_entries([1, 2]), script.window(3, length)]))
    assert both.forecasting.seqs[3].num_computed == 41 and len(both.forecasting.seqs[3].block_table) == 6
    assert both.last_order == [1, 2, 3]  # the prompt ended: 3 sampled its first token
    assert both.decode([1, 2, 3])


def test_a_lone_prompt_in_windows_and_a_window_of_another_length(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = Lockstep(tiny)
    script = both.script
    assert not both.run(script.prompt_step({5: 35}, chunk=10))
    assert both.run(script.step([script.window(5, 10)]))  # no decode rows at all
    # The scheduler's budget cut this one short: not the forecast window, staged in full.
    assert not both.run(script.step([script.window(5, 7)]))
    assert both.run(script.step([script.window(5, 7)]))  # as long as the last one
    # One token left: a window of one would pass for a decode in the batch; none is forecast.
    assert not both.run(script.step([script.window(5, 1)]))
    assert both.last_order == [5]
    assert both.decode([5])


def test_off_the_host_only_a_prompt_going_on_in_windows_is_forecast_and_uploaded_when_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A runner whose device is not the CPU (the meta device here, a GPU in the worker) forecasts
    only steps that leave a prompt unfinished. It builds the next window on the host from the
    sequences (the step's own batch is on the device), and a window taken from it is what a full
    staging builds, moved to the device whole. Decode-only steps are staged on arrival."""
    off_host = ModelRunner(None, None, BLOCK_SIZE, torch.device("meta"))  # type: ignore[arg-type]
    plain = ModelRunner(None, None, BLOCK_SIZE, torch.device("cpu"))  # type: ignore[arg-type]
    uploaded: list[ForwardBatch] = []
    upload_batch = runner_module.upload_batch

    def spy(batch: ForwardBatch, device: torch.device, upload: object = None) -> ForwardBatch:
        uploaded.append(batch)
        return upload_batch(batch, device, upload)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_module, "upload_batch", spy)
    script = SchedulerScript(BLOCK_SIZE)

    def stage(step: worker_pb2.Step) -> tuple[StagedStep, StagedStep]:
        staged = off_host.stage(step)
        off_host.forecast(staged)
        return staged, plain.stage(step)

    first, _ = stage(script.prompt_step({5: 30}, chunk=12))
    assert not first.forecast and first.batch is not None and first.batch.positions.device.type == "meta"
    for length in (12, 6):  # the forecast window is as long as the last one, or what is left
        staged, full = stage(script.step([script.window(5, length)]))
        assert staged.forecast and staged.batch is not None
        assert_same_batch(uploaded[-1], full.batch)
        assert staged.batch.input_ids.device.type == staged.batch.block_tables.device.type == "meta"
        assert all(
            p.key_slots is not None and p.key_slots.device.type == "meta" for p in staged.batch.prefills
        )
    assert len(uploaded) == 2
    # The last window ended the prompt; once its token is appended (finish), the decode that
    # follows is staged on arrival, as on a GPU every decode-only step is.
    assert [s.seq_id for s in staged.sampled] == [s.seq_id for s in full.sampled] == [5]
    for state in (*staged.sampled, *full.sampled):
        state.token_ids.append(7)
    script.seqs[5].tokens.append(7)
    decode, _ = stage(script.step(script.decode_entries([5])))
    assert not decode.forecast and len(uploaded) == 2


def test_a_step_the_worker_cannot_follow_fails_as_it_would_without_a_forecast(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = Lockstep(tiny)
    both.run(both.script.prompt_step({1: 5, 2: 8}))
    both.decode([1, 2])
    both.decode([1, 2])
    entries = both.script.decode_entries([1, 2])
    wrong = [
        RunningEntry(e.seq_id, e.num_computed_tokens + (e.seq_id == 2), 1, e.new_block_ids) for e in entries
    ]
    step = both.script.step(wrong)
    errors = []
    for runner in (both.forecasting, both.plain):
        with pytest.raises(StepError) as caught:
            runner.stage(step)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert "sequence 2 has" in errors[0] and "the scheduler says" in errors[0]


def test_a_forecast_is_taken_once(tiny: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    runner: ModelRunner = cpu_runner(tiny, "cpu", BLOCK_SIZE)
    script = SchedulerScript(BLOCK_SIZE)
    script.take_tokens(runner.run(runner.stage(script.prompt_step({1: 5}))))
    first = script.step(script.decode_entries([1]))
    staged = runner.stage(first)
    runner.forecast(staged)
    script.take_tokens(runner.run(staged))
    step = script.step(script.decode_entries([1]))
    assert runner.stage(step).forecast
    # The same step again (as a scheduler bug would send it): staged in full, and refused there.
    with pytest.raises(StepError, match="sequence 1 has"):
        runner.stage(step)


@pytest.mark.parametrize(
    ("field_name", "data", "message"),
    [
        ("seq_ids", b"\x01" * 9, "running.seq_ids: 9 bytes"),
        ("num_new_tokens", b"\x01\x00\x00\x00" * 2, "running.num_new_tokens: 2 entries for 1 sequences"),
        (
            "new_block_ids",
            b"\x05\x00\x00\x00",
            "running.new_block_ids: 1 entries, num_new_blocks add up to 0",
        ),
    ],
)
def test_a_malformed_running_list_is_refused_naming_its_field(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], field_name: str, data: bytes, message: str
) -> None:
    runner = cpu_runner(tiny, "cpu", BLOCK_SIZE)
    running = pack_running([RunningEntry(1, 4, 1)])
    setattr(running, field_name, data)
    with pytest.raises(StepError, match=message):
        runner.stage(worker_pb2.Step(step_id=7, running=running))


def test_a_release_in_one_lane_drops_the_other_lanes_forecast_of_that_sequence(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = Lockstep(tiny)
    both.run(both.script.prompt_step({1: 5, 2: 8}, lane=0))
    both.run(both.script.prompt_step({3: 6, 4: 9}, lane=1))
    for _ in range(2):
        assert both.decode([1, 2], lane=0)
        assert both.decode([3, 4], lane=1)
    # Sequence 3 finished in lane 1's last step; lane 0's next step says so.
    entries = both.script.decode_entries([1, 2])
    released = np.asarray([3], dtype="<u8").tobytes()
    assert both.run(both.script.step(entries, lane=0, released_seq_ids=released))
    assert 3 not in both.forecasting.forecasts.filed_under()
    assert not both.decode([4], lane=1)  # lane 1's forecast went with it: staged in full
    assert both.decode([4], lane=1)


def test_a_step_staged_in_full_drops_the_forecasts_that_share_a_sequence_with_it(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    both = Lockstep(tiny)
    script = both.script
    both.run(script.prompt_step({1: 5, 2: 8}, lane=0))
    both.run(script.prompt_step({3: 6, 4: 9}, lane=1))
    assert both.decode([1, 2], lane=0)
    assert both.decode([3, 4], lane=1)
    # Lane 0 admits a prompt and says 3 is gone: staged in full, so lane 1's forecast of 3 and 4
    # must go (Lockstep checks that no forecast stays filed under a dropped sequence).
    released = np.asarray([3], dtype="<u8").tobytes()
    step = script.prompt_step({5: 7}, running=script.decode_entries([1, 2]))
    step.released_seq_ids = released
    assert not both.run(step)
    assert not both.decode([4], lane=1)  # its forecast went: staged in full
    assert both.decode([4], lane=1)

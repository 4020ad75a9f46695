"""The worker's warm-up: every kind of step serving meets, through the whole step path, before Ready."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model_config import ModelConfig
from gpu_worker.runner import PendingStep, StagedStep
from gpu_worker.sampler import Sampler, SamplingParams, SamplingRow
from gpu_worker.startup import warm_up
from tests.worker_steps import cpu_runner, save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warm_up_runs_a_prefill_decodes_and_a_mixed_step_then_forgets_them(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]], backend: str
) -> None:
    block_size = 16
    runner = cpu_runner(tiny, backend, block_size)
    kinds: list[tuple[int, list[int]]] = []  # per step: decode rows, prefill chunk lengths
    sampled_all: list[bool] = []
    execute = runner.execute

    def recording(staged: StagedStep, yield_point: object = None) -> PendingStep:
        batch = staged.batch
        assert batch is not None
        decodes = batch.decode.num_seqs if batch.decode is not None else 0
        kinds.append((decodes, [chunk.num_tokens for chunk in batch.prefills]))
        pending = execute(staged, yield_point)  # type: ignore[arg-type]
        sampled_all.append(
            pending.output is not None and len(pending.output.token_ids) == len(staged.sampled)
        )
        return pending

    params: list[tuple[float, int, float]] = []
    stage = runner.stage

    def staging(step: object) -> StagedStep:
        staged = stage(step)  # type: ignore[arg-type]
        params.extend((s.sampling.temperature, s.sampling.top_k, s.sampling.top_p) for s in staged.sampled)
        return staged

    runner.execute = recording  # type: ignore[method-assign]
    runner.stage = staging  # type: ignore[method-assign]
    warm_up(runner, block_size)
    assert kinds == [(0, [block_size - 1]), (1, []), (1, []), (1, [3])]
    assert all(sampled_all), "a warm-up step sampled no token for a sequence"
    # Greedy as the scheduler sends it (no penalty) for the first sequence, a drawn token for the second.
    greedy = (0.0, 0, 1.0)
    assert params[:3] == [greedy] * 3 and len(params) == 5
    drawn = [p for p in params[3:] if p != greedy]
    assert len(drawn) == 1 and drawn[0][0] > 0 and drawn[0][1] > 0 and drawn[0][2] < 1.0, params
    assert not runner.seqs and not runner.forecasts, "warm-up left sequences or forecasts behind"


def test_warm_up_leaves_the_seeded_sampler_as_it_found_it(
    tiny: tuple[ModelConfig, dict[str, torch.Tensor]],
) -> None:
    # Its drawn token takes a number from the worker's generator: with --seed, the first request
    # must still draw the number a worker without warm-up would.
    runner = cpu_runner(tiny, "torch", 16)
    runner.sampler = Sampler(seed=7)
    warm_up(runner, 16)
    row = SamplingRow(SamplingParams(temperature=1.0), [1, 2, 3], [])
    cpu = torch.device("cpu")
    assert runner.sampler._uniforms([row], cpu).tolist() == Sampler(seed=7)._uniforms([row], cpu).tolist()

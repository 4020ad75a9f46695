"""BatchPlanner on tiny pools: token budget, chunked prefill, preemption order, DBO lanes."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from scheduler.block_manager import BlockManager
from scheduler.planner import BatchPlanner, PlannerLimits, StepPlan
from scheduler.request import Request, RequestParams, RequestState


def make_request(seq_id: int, prompt_len: int, arrival: float | None = None) -> Request:
    return Request(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        params=RequestParams(max_tokens=100),
        detokenizer=cast(Any, None),  # the planner never detokenizes
        events=asyncio.Queue(),
        arrival_time=float(seq_id) if arrival is None else arrival,
    )


def make_planner(
    num_blocks: int,
    block_size: int,
    budget: int = 1000,
    chunk: int = 1000,
    inflight: int = 1,
    seqs: int = 64,
    min_lane: int = 1,
) -> BatchPlanner:
    limits = PlannerLimits(
        max_batched_tokens=budget,
        max_num_seqs=seqs,
        prefill_chunk=chunk,
        max_inflight=inflight,
        min_lane_seqs=min_lane,
    )
    return BatchPlanner(BlockManager(num_blocks, block_size), limits)


def dispatch(plan: StepPlan | None) -> StepPlan:
    assert plan is not None
    for scheduled in plan.seqs:
        scheduled.request.in_flight = True
    return plan


def complete(plan: StepPlan, next_token: int = 7) -> None:
    """What the output processor does with a result: advance, and sample at the end of the known tokens."""
    for scheduled in plan.seqs:
        request = scheduled.request
        request.in_flight = False
        request.num_computed_tokens += scheduled.num_new_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(next_token)


def summary(plan: StepPlan | None) -> list[tuple[int, int, list[int]]]:
    assert plan is not None
    return [(s.request.seq_id, s.num_new_tokens, s.new_block_ids) for s in plan.seqs]


def test_chunked_prefill_splits_a_long_prompt_at_chunk_boundaries() -> None:
    planner = make_planner(num_blocks=8, block_size=8, chunk=16)
    request = make_request(1, prompt_len=40)
    planner.add(request)
    steps = []
    for _ in range(4):
        plan = dispatch(planner.plan())
        steps.append(summary(plan))
        complete(plan)
    assert steps == [
        [(1, 16, [0, 1])],
        [(1, 16, [2, 3])],
        [(1, 8, [4])],  # the last chunk samples the first output token
        [(1, 1, [5])],  # the decode at position 40 opens block 5
    ]
    assert request.output_token_ids == [7, 7]


def test_token_budget_is_shared_and_the_last_prompt_is_chunked() -> None:
    planner = make_planner(num_blocks=16, block_size=4, budget=25)
    for seq_id in (1, 2, 3):
        planner.add(make_request(seq_id, prompt_len=10))
    assert [(s, n) for s, n, _ in summary(planner.plan())] == [(1, 10), (2, 10), (3, 5)]


def test_running_decodes_come_before_continuing_prefills_and_new_requests() -> None:
    planner = make_planner(num_blocks=32, block_size=4, budget=12, chunk=8)
    early = make_request(1, prompt_len=4)
    long = make_request(2, prompt_len=20)
    planner.add(early)
    planner.add(long)
    complete(dispatch(planner.plan()))  # early: 4 (samples), long: 8
    planner.add(make_request(3, prompt_len=4))
    plan = planner.plan()
    # early decodes (1), long continues its prefill (8), the newcomer gets the 3 tokens left.
    assert [(s, n) for s, n, _ in summary(plan)] == [(1, 1), (2, 8), (3, 3)]


def test_full_pool_preempts_the_latest_arrival_and_requeues_it_first() -> None:
    planner = make_planner(num_blocks=4, block_size=4)
    first, second = make_request(1, prompt_len=8), make_request(2, prompt_len=8)
    planner.add(first)
    planner.add(second)
    complete(dispatch(planner.plan()))
    assert planner.blocks.num_free_blocks == 0
    waiting_newcomer = make_request(3, prompt_len=4)
    planner.add(waiting_newcomer)
    # Both decode at position 8: each needs a third block and none is free.
    plan = planner.plan()
    assert plan is not None
    assert [r.seq_id for r in plan.preempted] == [2]
    assert summary(plan) == [(1, 1, [3])]  # block 3 was second's tail, freed first
    assert second.state is RequestState.WAITING
    assert second.num_computed_tokens == 0 and second.output_token_ids == [7]  # tokens kept
    assert list(planner.waiting) == [second, waiting_newcomer]
    planner.blocks.check_integrity()


def test_a_request_that_cannot_grow_waits_while_the_others_are_in_flight() -> None:
    planner = make_planner(num_blocks=2, block_size=4, inflight=2)
    a, b = make_request(1, prompt_len=4), make_request(2, prompt_len=4)
    planner.add(a)
    planner.add(b)
    complete(dispatch(planner.plan()))
    in_flight = dispatch(planner.plan())  # lane share: one of the two
    assert [s.request.seq_id for s in in_flight.seqs] == [1]
    # b needs a second block; a is in flight so it cannot be the victim; b preempts itself.
    plan = planner.plan()
    assert plan is None
    assert b.state is RequestState.WAITING
    assert [r.seq_id for r in planner.waiting] == [2]


def test_dbo_splits_the_running_set_into_lanes() -> None:
    planner = make_planner(num_blocks=64, block_size=4, inflight=2)
    requests = [make_request(i, prompt_len=3) for i in range(1, 6)]
    for request in requests:
        planner.add(request)
    complete(dispatch(planner.plan()))  # all five prefills in one step
    lane_a = dispatch(planner.plan())
    lane_b = dispatch(planner.plan())
    assert [s.request.seq_id for s in lane_a.seqs] == [1, 2, 3]  # ceil(5 / 2)
    assert [s.request.seq_id for s in lane_b.seqs] == [4, 5]
    assert planner.plan() is None  # every sequence is in flight
    complete(lane_a)
    assert [s.request.seq_id for s in summary_plan(planner)] == [1, 2, 3]


def test_dbo_does_not_split_below_min_lane_seqs_and_small_remainders_wait_to_merge() -> None:
    planner = make_planner(num_blocks=64, block_size=4, inflight=2, min_lane=3)
    for request in [make_request(i, prompt_len=3) for i in range(1, 4)]:
        planner.add(request)
    complete(dispatch(planner.plan()))
    lane_a = dispatch(planner.plan())
    assert [s.request.seq_id for s in lane_a.seqs] == [1, 2, 3]  # halves of 2 and 1 would be below 3
    planner.add(make_request(4, prompt_len=3))
    lane_b = dispatch(planner.plan())  # a new arrival is never held back
    assert summary(lane_b) == [(4, 3, [3])]
    complete(lane_b)
    assert planner.plan() is None  # one free decode is too few for a lane: it waits for lane a
    complete(lane_a)
    assert [s.request.seq_id for s in summary_plan(planner)] == [1, 2, 3, 4]  # one lane again


def summary_plan(planner: BatchPlanner) -> list[Any]:
    plan = planner.plan()
    assert plan is not None
    return plan.seqs


def test_removed_requests_free_their_blocks() -> None:
    planner = make_planner(num_blocks=4, block_size=4)
    request = make_request(1, prompt_len=9)
    planner.add(request)
    complete(dispatch(planner.plan()))
    planner.remove(request)
    assert planner.blocks.num_free_blocks == 4
    assert not planner.running and not planner.waiting
    assert request.state is RequestState.FINISHED

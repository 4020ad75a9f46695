"""BatchPlanner on tiny pools: token budget, chunked prefill, preemption order, DBO lanes."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

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
    lookahead: bool = False,
) -> BatchPlanner:
    limits = PlannerLimits(
        max_batched_tokens=budget,
        max_num_seqs=seqs,
        prefill_chunk=chunk,
        max_inflight=inflight,
        min_lane_seqs=min_lane,
        lookahead=lookahead,
    )
    # A clock that stays at 0: arrivals (at their seq ids, in seconds) never age.
    return BatchPlanner(BlockManager(num_blocks, block_size), limits, clock=lambda: 0.0)


def dispatch(plan: StepPlan | None) -> StepPlan:
    assert plan is not None
    for scheduled in plan.seqs:
        scheduled.request.joined(scheduled.num_new_tokens, scheduled.samples)
    return plan


def complete(plan: StepPlan, next_token: int = 7) -> None:
    """What the output processor does with a result: advance, and append the token a sampling chunk samples."""
    for scheduled in plan.seqs:
        request = scheduled.request
        request.returned(scheduled.num_new_tokens, scheduled.samples)
        if scheduled.samples:
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


def test_dbo_does_not_split_below_min_lane_seqs_and_small_work_waits_to_merge() -> None:
    planner = make_planner(num_blocks=64, block_size=4, inflight=2, min_lane=3)
    for request in [make_request(i, prompt_len=3) for i in range(1, 4)]:
        planner.add(request)
    complete(dispatch(planner.plan()))
    lane_a = dispatch(planner.plan())
    assert [s.request.seq_id for s in lane_a.seqs] == [1, 2, 3]  # halves of 2 and 1 would be below 3
    planner.add(make_request(4, prompt_len=3))
    assert planner.plan() is None  # one new prefill is too little for a lane: it waits for lane a
    planner.add(make_request(5, prompt_len=3))
    planner.add(make_request(6, prompt_len=3))
    lane_b = dispatch(planner.plan())  # three waiting requests make a lane
    assert [s.request.seq_id for s in lane_b.seqs] == [4, 5, 6]
    complete(lane_a)
    complete(lane_b)
    # Six free decodes: equal shares of three are big enough, so the lanes split evenly.
    assert [s.request.seq_id for s in dispatch(planner.plan()).seqs] == [1, 2, 3]
    assert [s.request.seq_id for s in dispatch(planner.plan()).seqs] == [4, 5, 6]


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


# ------------------------------------------------------------------------------ classes, prefix cache, window


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def classed(seq_id: int, prompt_len: int, priority: int, arrival: float) -> Request:
    request = make_request(seq_id, prompt_len, arrival)
    request.params = RequestParams(max_tokens=100, priority=priority)
    return request


def make_classed_planner(num_blocks: int, clock: FakeClock, **limits: Any) -> BatchPlanner:
    settings = {"max_batched_tokens": 1000, "max_num_seqs": 64, "prefill_chunk": 1000, "max_inflight": 1}
    settings.update(limits)
    return BatchPlanner(BlockManager(num_blocks, 4), PlannerLimits(**settings), clock=clock)


def test_waiting_requests_go_by_class_then_arrival() -> None:
    clock = FakeClock()
    planner = make_classed_planner(64, clock, max_num_seqs=3)
    for seq_id, priority in ((1, 2), (2, 1), (3, 0), (4, 1), (5, 0)):
        planner.add(classed(seq_id, 3, priority, arrival=float(seq_id)))
    clock.now = 5.0
    assert [s.request.seq_id for s in dispatch(planner.plan()).seqs] == [3, 5, 2]


def test_an_interactive_request_preempts_the_lowest_class_latest_arrival_for_blocks() -> None:
    clock = FakeClock()
    planner = make_classed_planner(4, clock)  # 4 blocks of 4 tokens
    batch_old = classed(1, 3, priority=2, arrival=0.0)
    standard = classed(2, 3, priority=1, arrival=1.0)
    batch_new = classed(3, 3, priority=2, arrival=2.0)
    for request in (batch_old, standard, batch_new):
        planner.add(request)
    clock.now = 2.0
    complete(dispatch(planner.plan()))  # one block each; their decodes fit in it
    assert planner.blocks.num_free_blocks == 1
    urgent = classed(4, 8, priority=0, arrival=3.0)  # needs two blocks
    planner.add(urgent)
    clock.now = 3.0
    plan = planner.plan()
    assert plan is not None
    assert [r.seq_id for r in plan.preempted] == [3]  # batch class, and the later of the two
    assert summary(plan) == [(4, 8, [3, 2]), (2, 1, []), (1, 1, [])]  # block 2 was batch_new's
    assert batch_new.state is RequestState.WAITING and batch_new.preemptions_in_a_row == 1
    assert planner.num_priority_preemptions == 1
    planner.blocks.check_integrity()


def test_priority_preemption_spares_a_request_preempted_too_often_in_a_row() -> None:
    clock = FakeClock()
    planner = make_classed_planner(8, clock, max_num_seqs=1, max_preemptions_in_a_row=1)
    bulk = classed(1, 3, priority=2, arrival=0.0)
    planner.add(bulk)
    complete(dispatch(planner.plan()))
    bulk.preemptions_in_a_row = 1  # as if just recomputed after a preemption, with no new token yet
    planner.add(classed(2, 3, priority=0, arrival=1.0))
    clock.now = 1.0
    plan = planner.plan()  # the only batch slot is bulk's, and bulk is spared
    assert plan is not None and plan.preempted == [] and summary(plan) == [(1, 1, [])]
    bulk.preemptions_in_a_row = 0  # it produced a token since
    plan = planner.plan()
    assert plan is not None and plan.preempted == [bulk]
    assert [s.request.seq_id for s in plan.seqs] == [2]


@pytest.mark.parametrize(("now", "first"), [(15.0, 2), (21.0, 1)])
def test_aging_lets_a_batch_request_overtake_newer_interactive_ones(now: float, first: int) -> None:
    # At 15 s the batch request has risen one class (to standard): interactive still goes first.
    # At 21 s it has risen two classes, and it arrived first.
    clock = FakeClock()
    planner = make_classed_planner(64, clock, max_num_seqs=1, aging_seconds=10.0)
    planner.add(classed(1, 3, priority=2, arrival=0.0))
    planner.add(classed(2, 3, priority=0, arrival=14.0))
    clock.now = now
    assert [s.request.seq_id for s in dispatch(planner.plan()).seqs] == [first]


def test_a_repeated_prompt_prefills_only_its_uncached_tail() -> None:
    planner = make_planner(num_blocks=16, block_size=4)
    first = make_request(1, prompt_len=10)
    planner.add(first)
    plan = dispatch(planner.plan())
    assert summary(plan) == [(1, 10, [0, 1, 2])]
    complete(plan)
    planner.blocks.commit(1, first.all_token_ids(), first.num_computed_tokens)
    second = make_request(2, prompt_len=10)  # same token ids
    planner.add(second)
    # Blocks 0 and 1 (8 tokens) are reused; the last 2 prompt tokens are computed in a new block.
    assert [(s.request.seq_id, s.num_new_tokens, s.new_block_ids) for s in planner.plan().seqs] == [  # type: ignore[union-attr]
        (1, 1, []),
        (2, 2, [3]),
    ]
    assert second.num_computed_tokens == 8 and second.num_cached_prompt_tokens == 8
    assert planner.blocks.table(2) == [0, 1, 3]
    assert planner.prefix_hit_ratio == 8 / 20


def test_prefill_window_holds_a_new_prompt_back_only_while_the_worker_has_work() -> None:
    clock = FakeClock()
    planner = make_classed_planner(64, clock, prefill_window=0.05)
    planner.add(classed(1, 3, priority=1, arrival=0.0))
    assert planner.plan(worker_idle=False) is None  # waits for company...
    assert planner.window_expiry() == pytest.approx(0.05 * (1 - 3 / 1000))
    assert planner.plan(worker_idle=True) is not None  # ...but never while the worker would idle
    planner.add(classed(2, 3, priority=1, arrival=0.0))
    clock.now = 0.06
    assert planner.plan(worker_idle=False) is not None  # its window is over


def test_queued_prompt_tokens_count_only_requests_that_never_ran() -> None:
    planner = make_planner(num_blocks=64, block_size=4)
    first, second = make_request(1, prompt_len=5), make_request(2, prompt_len=7)
    planner.add(first)
    planner.add(second)
    assert planner.queued_prompt_tokens == 12
    planner.remove(second)
    assert planner.queued_prompt_tokens == 5
    dispatch(planner.plan())
    assert planner.queued_prompt_tokens == 0


def test_an_urgent_step_holds_only_interactive_prompts_without_a_first_token() -> None:
    clock = FakeClock()
    planner = make_classed_planner(64, clock, max_batched_tokens=20, prefill_chunk=8, max_inflight=2)
    bulk = [classed(i, 5, priority=2, arrival=float(i)) for i in (1, 2)]
    for request in bulk:
        planner.add(request)
    in_flight = dispatch(planner.plan())
    assert not planner.has_urgent() and planner.plan_urgent() is None
    long_prompt = classed(3, 12, priority=0, arrival=3.0)  # two chunks of 8 and 4
    short_prompt = classed(4, 3, priority=0, arrival=4.0)
    standard = classed(5, 3, priority=1, arrival=2.5)
    for request in (long_prompt, short_prompt, standard):
        planner.add(request)
    assert planner.has_urgent()
    first = dispatch(planner.plan_urgent())
    assert summary(first) == [(3, 8, [4, 5]), (4, 3, [6])]  # no bulk decodes, no standard prompt
    assert standard.state is RequestState.WAITING
    complete(first)
    # The long prompt's second chunk is still before its first token: urgent again; the short
    # prompt now decodes and waits for an ordinary step.
    assert planner.has_urgent()
    second = dispatch(planner.plan_urgent())
    assert summary(second) == [(3, 4, [7])]
    complete(second)
    assert not planner.has_urgent() and planner.plan_urgent() is None
    complete(in_flight)
    lanes = [dispatch(planner.plan()), dispatch(planner.plan())]  # ordinary DBO lanes again
    assert sorted(s.request.seq_id for lane in lanes for s in lane.seqs) == [1, 2, 3, 4, 5]
    planner.blocks.check_integrity()


def plans(planner: BatchPlanner) -> list[tuple[int, int, list[int], bool]]:
    """The next plan's (seq id, new tokens, new blocks, samples), dispatched; [] when there is none."""
    plan = planner.plan(worker_idle=False)
    if plan is None:
        return []
    dispatch(plan)
    return [(s.request.seq_id, s.num_new_tokens, s.new_block_ids, s.samples) for s in plan.seqs]


def test_lookahead_plans_a_sequences_next_step_while_its_current_one_is_in_flight() -> None:
    """One CPU-style lane (min_lane_seqs = max_num_seqs): each chunk's successor is planned while
    it computes, one step ahead at most; the decode after the last chunk too, with the block its
    position opens, although its input token is not sampled yet."""
    planner = make_planner(
        num_blocks=16, block_size=4, chunk=8, inflight=2, seqs=4, min_lane=4, lookahead=True
    )
    request = make_request(1, prompt_len=20)
    request.params = RequestParams(max_tokens=3)
    planner.add(request)
    first = planner.plan()
    assert first is not None and summary(dispatch(first)) == [(1, 8, [0, 1])]
    assert plans(planner) == [(1, 8, [2, 3], False)]  # where the first chunk ends
    assert plans(planner) == []  # in two steps already
    assert request.num_computed_tokens == 0 and request.num_scheduled_tokens == 16
    complete(first)
    assert plans(planner) == [(1, 4, [4], True)]  # the last chunk samples the first token
    assert plans(planner) == []
    assert request.num_scheduled_tokens == 20 and request.num_unscheduled_tokens == 1
    assert request.is_decoding and request.output_tokens_to_come == 2


def test_lookahead_stops_at_the_step_that_samples_the_last_token() -> None:
    planner = make_planner(num_blocks=16, block_size=4, inflight=2, seqs=4, min_lane=4, lookahead=True)
    request = make_request(1, prompt_len=4)
    request.params = RequestParams(max_tokens=2)
    planner.add(request)
    prompt = dispatch(planner.plan())
    # Position 4 opens block 1 before the token that goes there is even sampled.
    decode = planner.plan(worker_idle=False)
    assert summary(decode) == [(1, 1, [1])] and decode is not None and decode.seqs[0].samples
    dispatch(decode)
    complete(prompt)
    # The decode in flight samples token 2 of 2: nothing follows it.
    assert request.output_tokens_to_come == 0
    assert planner.plan(worker_idle=False) is None
    complete(decode)
    assert request.output_token_ids == [7, 7]  # the output processor finishes it here


def test_sequences_not_in_flight_go_first_so_lanes_still_split() -> None:
    """GPU-style lanes (an even split): with lookahead the second lane takes the other half, not a
    lookahead of the first; lookaheads only fill a lane's share when free sequences run out."""
    planner = make_planner(num_blocks=32, block_size=4, inflight=2, lookahead=True)
    requests = [make_request(seq_id, prompt_len=3) for seq_id in (1, 2, 3, 4)]
    for request in requests:
        planner.add(request)
    complete(dispatch(planner.plan()))  # all four prompts in one step: each samples a token
    lane_a = planner.plan()
    assert lane_a is not None and [s.request.seq_id for s in dispatch(lane_a).seqs] == [1, 2]
    lane_b = planner.plan()
    assert lane_b is not None and [s.request.seq_id for s in dispatch(lane_b).seqs] == [3, 4]
    complete(lane_a)
    # 1 and 2 are free again and go first; 3 and 4 (in flight once) would be lookaheads.
    lane_a = planner.plan()
    assert lane_a is not None and [s.request.seq_id for s in dispatch(lane_a).seqs] == [1, 2]


def test_a_preemption_whose_victims_are_all_in_flight_stops_the_lookahead() -> None:
    """Two batch-class requests fill both slots and are always in flight with lookahead. An
    interactive one arrives: the plan finds its victims in flight, so it looks no further ahead;
    once their steps are back, the latest batch request is preempted for it."""
    clock = FakeClock()
    planner = make_classed_planner(64, clock, max_num_seqs=2, max_inflight=2, min_lane_seqs=2, lookahead=True)
    bulk = [classed(i, 3, priority=2, arrival=float(i)) for i in (1, 2)]
    for request in bulk:
        planner.add(request)
    first = dispatch(planner.plan())
    second = dispatch(planner.plan())  # the lookahead of both
    assert [s.request.seq_id for s in second.seqs] == [1, 2]
    complete(first)
    interactive = classed(3, 3, priority=0, arrival=3.0)
    planner.add(interactive)
    # Both bulk requests are in flight (in `second`): no victim now, and no lookahead either.
    assert planner.plan(worker_idle=False) is None
    assert interactive.state is RequestState.WAITING
    complete(second)
    plan = dispatch(planner.plan())
    assert [r.seq_id for r in plan.preempted] == [2]
    assert [s.request.seq_id for s in plan.seqs] == [3, 1]  # the admission, then the lower class
    planner.blocks.check_integrity()

"""BatchPlanner: what the next step computes, within the token budget and the KV pool.

Each step takes running sequences first (decodes, then continuing prefill chunks),
then admits waiting ones in arrival order as prefill chunks. When a running
sequence needs a block and the pool is empty, the latest-arrived running
sequence that is not in flight is preempted (recompute: its blocks freed, its
tokens kept, requeued at the front). With DBO the running set is split: one
batch takes at most its share of the running sequences (an equal split, or all
of them when equal shares would be smaller than `min_lane_seqs`), so the others
form the next batch while this one computes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestState


@dataclass(frozen=True, slots=True)
class PlannerLimits:
    max_batched_tokens: int
    max_num_seqs: int
    prefill_chunk: int
    max_inflight: int
    min_lane_seqs: int = 1  # DBO never splits the running set into lanes smaller than this


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    # Blocks appended to its table by this step: all a running sequence's worker lacks.
    new_block_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class BatchPlanner:
    """Holds the prefill (waiting) queue and the running set, and plans steps."""

    def __init__(self, blocks: BlockManager, limits: PlannerLimits) -> None:
        self.blocks = blocks
        self.limits = limits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finished or aborted)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.RUNNING:
            self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.state = RequestState.FINISHED

    def plan(self) -> StepPlan | None:
        """The next step's sequences, or None when there is nothing to run now."""
        if self._merge_with_inflight():
            return None
        plan = StepPlan()
        budget = self.limits.max_batched_tokens
        budget = self._plan_running(plan, budget)
        self._plan_waiting(plan, budget)
        return plan if plan.seqs else None

    def _merge_with_inflight(self) -> bool:
        """True when the free running sequences are too few for a lane of their own.

        They then wait for the in-flight batch to come back and join its next step, so lanes
        split by arrival timing merge again. New arrivals are never held back by this.
        """
        if self.waiting or self.limits.min_lane_seqs <= 1:
            return False
        free = sum(1 for r in self.running if not r.in_flight)
        return free < self.limits.min_lane_seqs and free < len(self.running)

    def _lane_share(self) -> int:
        # ceil(running / lanes): each in-flight batch carries an equal share, unless shares that
        # small are not worth a step of their own; then one batch takes them all.
        even = -(-len(self.running) // self.limits.max_inflight)
        return max(1, even if even >= self.limits.min_lane_seqs else len(self.running))

    def _plan_running(self, plan: StepPlan, budget: int) -> int:
        candidates = [r for r in self.running if not r.in_flight]
        candidates.sort(key=lambda r: not r.is_decoding)  # stable: decodes first, then by admission
        share = self._lane_share()
        scheduled: set[int] = set()
        for request in candidates:
            if budget <= 0 or len(plan.seqs) >= min(share, self.limits.max_num_seqs):
                break
            if request.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_uncomputed_tokens, budget, self.limits.prefill_chunk)
            new_blocks = self._allocate_or_preempt(request, num_new, plan, scheduled)
            if new_blocks is None:
                continue
            plan.seqs.append(ScheduledSeq(request, num_new, new_blocks))
            scheduled.add(request.seq_id)
            budget -= num_new
        return budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan, scheduled: set[int]
    ) -> list[int] | None:
        target = request.num_computed_tokens + num_new
        while (new_blocks := self.blocks.allocate(request.seq_id, target)) is None:
            victim = self._pick_victim(scheduled)
            if victim is None:
                return None  # the others are in flight; wait for them to come back
            self._preempt(victim, plan)
            if victim is request:
                return None
        return new_blocks

    def _pick_victim(self, scheduled: set[int]) -> Request | None:
        """The latest-arrived running request that is neither in flight nor in this step."""
        eligible = [r for r in self.running if not r.in_flight and r.seq_id not in scheduled]
        return max(eligible, key=lambda r: r.arrival_time, default=None)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.state = RequestState.WAITING
        # Ahead of every new arrival; among preempted ones the earlier-arrived goes first.
        index = 0
        while (
            index < len(self.waiting)
            and self.waiting[index].num_preemptions > 0
            and (self.waiting[index].arrival_time <= request.arrival_time)
        ):
            index += 1
        self.waiting.insert(index, request)
        plan.preempted.append(request)

    def _plan_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0:
            if len(plan.seqs) >= self.limits.max_num_seqs or len(self.running) >= self.limits.max_num_seqs:
                return
            request = self.waiting[0]
            num_new = min(request.num_uncomputed_tokens, budget, self.limits.prefill_chunk)
            new_blocks = self.blocks.allocate(request.seq_id, request.num_computed_tokens + num_new)
            if new_blocks is None:
                return  # head of line waits for blocks; running sequences will free some
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            self.running.append(request)
            plan.seqs.append(ScheduledSeq(request, num_new, new_blocks))
            budget -= num_new

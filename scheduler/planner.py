"""BatchPlanner: what the next step computes, within the token budget and the KV pool.

Each step takes running sequences first (decodes, then continuing prefill chunks), then
admits waiting ones as prefill chunks, starting from their longest cached prefix.

Order: priority class (interactive, standard, batch), then arrival. A request that has
waited `aging_seconds` counts one class higher per period waited, so `batch` requests still
get in under sustained interactive load.

Preemption (recompute: blocks freed, tokens kept, requeued by its class and arrival):
- when a running sequence needs a block and the pool is empty, the lowest-class,
  latest-arrived running sequence that is not in flight goes;
- when the head of the queue cannot be admitted for lack of blocks or batch slots, running
  sequences of a strictly lower class go, lowest class and latest arrival first, but never
  one already preempted `max_preemptions_in_a_row` times without producing a token since.

With DBO the running set is split: one batch takes at most its share of the running
sequences (an equal split, or all of them when equal shares would be smaller than
`min_lane_seqs`), so the others form the next batch while this one computes. Work too small
for a lane of its own (fewer than `min_lane_seqs` free sequences and waiting requests) waits
for the in-flight batch and joins its next step.

Lookahead (`lookahead`, where the worker takes it): a sequence whose step is in flight may
join the next step too, as that step's continuation. Its chunk starts where the one in flight
ends, and a decode's input is the token the step in flight samples, which the worker fills in
itself. So the worker holds its next step before it finishes the current one and never waits for
the scheduler in between, with one lane as with two. Only one step ahead, never for a request
its step in flight ends by max_tokens, and sequences not in flight go first, so lanes still
split the running set. A request that ends in the step in flight (EOS, a stop string) computes
one token more in the next, which is dropped. A preemption whose victims are all in flight
stops the plan looking ahead, so that they come back and can be preempted.

Urgent steps: while a batch is in flight, interactive requests still waiting for their
first token may go out at once as a step of their own (`plan_urgent`), which the worker
runs at the next layer boundary of the step in progress. Their time to first token is then
their own prefill plus at most one block of the step they interrupt, however long that is.

Prefill window: a new request may wait up to `prefill_window` seconds for others to batch
its prefill with; the wait shrinks as queued prompt tokens approach the token budget and is
skipped when the worker would otherwise have nothing to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.request import Request, RequestState

RANKS = ("interactive", "standard", "batch")  # RequestParams.priority indexes this


@dataclass(frozen=True, slots=True)
class PlannerLimits:
    max_batched_tokens: int
    max_num_seqs: int
    prefill_chunk: int
    max_inflight: int
    min_lane_seqs: int = 1  # DBO never splits the running set into lanes smaller than this
    aging_seconds: float = 10.0  # a waiting request rises one class per this many seconds
    max_preemptions_in_a_row: int = 2  # priority preemptions a request takes before it is spared
    prefill_window: float = 0.0  # seconds a new prefill may wait for others to batch with
    lookahead: bool = False  # plan a sequence's next step while its current one is in flight


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    # Blocks appended to its table by this step: all a running sequence's worker lacks.
    new_block_ids: list[int]
    samples: bool  # the step reaches its newest token and samples the next one


def _scheduled(request: Request, num_new: int, new_block_ids: list[int]) -> ScheduledSeq:
    return ScheduledSeq(request, num_new, new_block_ids, samples=num_new == request.num_unscheduled_tokens)


@dataclass(slots=True)
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_running: int = 0  # of seqs, those that were already running (what the DBO lane share limits)
    # A preemption found its only victims in flight: look no further ahead, so that they come back.
    waits_for_victims: bool = False


class BatchPlanner:
    """Holds the prefill (waiting) queue and the running set, and plans steps."""

    def __init__(
        self, blocks: BlockManager, limits: PlannerLimits, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.blocks = blocks
        self.limits = limits
        self.clock = clock
        self.waiting: list[Request] = []  # sorted by `_queue_key` at each plan
        self.running: list[Request] = []  # in admission order
        self.queued_prompt_tokens = 0  # prompt tokens of waiting requests that never ran
        # Prompt tokens of first admissions, and how many of them the prefix cache held.
        self.prompt_tokens_admitted = 0
        self.prompt_tokens_cached = 0
        self.num_priority_preemptions = 0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prompt_tokens_cached / self.prompt_tokens_admitted if self.prompt_tokens_admitted else 0.0

    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)
        self.queued_prompt_tokens += request.prompt_len

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finished or aborted)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                self.queued_prompt_tokens -= request.prompt_len
        elif request.state is RequestState.RUNNING:
            self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.state = RequestState.FINISHED

    def plan(self, worker_idle: bool = True) -> StepPlan | None:
        """The next step's sequences, or None when there is nothing to run now.

        `worker_idle`: nothing else is in flight, so holding a prefill back would idle the worker.

        Order within a step: running sequences of a class at least as high as the head of the
        queue, then admissions from the queue (which may preempt lower classes), then the
        remaining running sequences, for whose decodes one token each of the budget is kept.
        """
        if self._merge_with_inflight():
            return None
        plan = StepPlan()
        now = self.clock()
        self.waiting.sort(key=lambda r: (self._rank(r, now), r.arrival_time, r.seq_id))
        head_rank = self._rank(self.waiting[0], now) if self.waiting else len(RANKS)
        budget = self.limits.max_batched_tokens
        budget = self._plan_running(plan, budget, lambda r: r.params.priority <= head_rank)
        deferred = sum(
            1
            for r in self.running
            if r.is_decoding and self._schedulable(r) and r.params.priority > head_rank
        )
        reserve = min(deferred, budget)
        hold_back = not worker_idle or bool(plan.seqs)
        budget = self._plan_waiting(plan, budget - reserve, now, hold_back) + reserve
        self._plan_running(plan, budget, lambda r: True)
        return plan if plan.seqs else None

    def has_urgent(self) -> bool:
        """Whether an interactive request waits for its first token (see `plan_urgent`)."""
        return any(self._urgent(r) for r in self.waiting) or any(
            self._urgent(r) and not r.in_flight for r in self.running
        )

    def plan_urgent(self) -> StepPlan | None:
        """A step of interactive prefills only, to run inside the batch in flight; None if none can start.

        Continuing chunks of interactive prompts first, then admissions (which may preempt lower
        classes for blocks or slots, as in `plan`). Decodes are left to the ordinary steps: an
        urgent step exists to cut time to first token, and each one costs a pass over the weights.
        """
        plan = StepPlan()
        # Never a lookahead: an urgent step may run before the step in flight it would continue.
        budget = self._plan_running(plan, self.limits.max_batched_tokens, self._urgent, lookahead=False)
        now = self.clock()
        self.waiting.sort(key=lambda r: (self._rank(r, now), r.arrival_time, r.seq_id))
        self._plan_waiting(plan, budget, now, hold_back=False, include=self._urgent)
        return plan if plan.seqs else None

    @staticmethod
    def _urgent(request: Request) -> bool:
        """An interactive request that has produced no token yet (prefill or waiting to start)."""
        return request.params.priority == 0 and not request.output_token_ids

    def window_expiry(self) -> float | None:
        """When the oldest held-back prefill's window ends (clock time), if one is held back."""
        if self.limits.prefill_window <= 0 or not self.waiting:
            return None
        return min(r.arrival_time for r in self.waiting) + self._window()

    # ------------------------------------------------------------------ ordering

    def _rank(self, request: Request, now: float) -> int:
        """Class rank (0 = interactive) after aging."""
        waited = now - request.arrival_time
        return max(0, request.params.priority - int(waited / self.limits.aging_seconds))

    def _window(self) -> float:
        fill = self.queued_prompt_tokens / self.limits.max_batched_tokens
        return self.limits.prefill_window * max(0.0, 1.0 - fill)

    # ------------------------------------------------------------------ running

    def _schedulable(self, request: Request, lookahead: bool = True) -> bool:
        """Whether `request` may join the step being planned: not in flight, or (looking ahead) in
        one in-flight step that does not end it."""
        if not request.in_flight:
            return True
        return (
            lookahead
            and self.limits.lookahead
            and request.inflight_steps == 1
            and not request.aborted
            and request.output_tokens_to_come > 0
        )

    def _merge_with_inflight(self) -> bool:
        """True when the work that can go now is too little for a batch of its own.

        Free running sequences and waiting requests together below `min_lane_seqs`, while
        sequences in flight will want a later step: the free ones wait for those to come back
        and join their next step, so lanes split by arrival timing merge again. Every step pays
        a fixed cost (on a CPU, a pass over all the weights), which a small lane would pay again
        for little work. Sequences their step in flight ends do not count: nothing follows them.
        """
        if self.limits.min_lane_seqs <= 1:
            return False
        free = sum(1 for r in self.running if self._schedulable(r))
        coming_back = any(
            not self._schedulable(r) and not r.aborted and r.output_tokens_to_come > 0 for r in self.running
        )
        return coming_back and free + len(self.waiting) < self.limits.min_lane_seqs

    def _lane_share(self) -> int:
        # ceil(running / lanes): each in-flight batch carries an equal share, unless shares that
        # small are not worth a step of their own; then one batch takes them all.
        even = -(-len(self.running) // self.limits.max_inflight)
        return max(1, even if even >= self.limits.min_lane_seqs else len(self.running))

    def _plan_running(
        self, plan: StepPlan, budget: int, include: Callable[[Request], bool], lookahead: bool = True
    ) -> int:
        scheduled = {s.request.seq_id for s in plan.seqs}
        candidates = [
            r
            for r in self.running
            if r.seq_id not in scheduled and include(r) and self._schedulable(r, lookahead)
        ]
        # Stable: sequences not in flight first, decodes before continuing prefills; each by class,
        # then admission order.
        candidates.sort(key=lambda r: (r.in_flight, not r.is_decoding, r.params.priority))
        share = self._lane_share()
        for request in candidates:
            if budget <= 0 or plan.num_running >= share or len(plan.seqs) >= self.limits.max_num_seqs:
                break
            if request.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            if request.in_flight and plan.waits_for_victims:
                continue
            num_new = min(request.num_unscheduled_tokens, budget, self.limits.prefill_chunk)
            new_blocks = self._allocate_or_preempt(request, num_new, plan, scheduled)
            if new_blocks is None:
                continue
            plan.seqs.append(_scheduled(request, num_new, new_blocks))
            plan.num_running += 1
            scheduled.add(request.seq_id)
            budget -= num_new
        return budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, plan: StepPlan, scheduled: set[int]
    ) -> list[int] | None:
        target = request.num_scheduled_tokens + num_new
        while (new_blocks := self.blocks.allocate(request.seq_id, target)) is None:
            victim = self._pick_victim(plan, scheduled)
            if victim is None:
                return None  # the others are in flight; wait for them to come back
            self._preempt(victim, plan)
            if victim is request:
                return None
        return new_blocks

    def _pick_victim(
        self, plan: StepPlan, scheduled: set[int], below_rank: int | None = None
    ) -> Request | None:
        """The lowest-class, latest-arrived running request that is neither in flight nor in this step.

        With `below_rank` (priority preemption): only classes strictly below it, and only
        requests not yet preempted `max_preemptions_in_a_row` times in a row. When the only
        candidates are in flight, the plan stops looking ahead (`waits_for_victims`).
        """
        eligible = [r for r in self.running if r.seq_id not in scheduled]
        if below_rank is not None:
            eligible = [
                r
                for r in eligible
                if r.params.priority > below_rank
                and r.preemptions_in_a_row < self.limits.max_preemptions_in_a_row
            ]
        free = [r for r in eligible if not r.in_flight]
        if not free and eligible:
            plan.waits_for_victims = True
        return max(free, key=lambda r: (r.params.priority, r.arrival_time), default=None)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.blocks.free(request.seq_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.preemptions_in_a_row += 1
        request.state = RequestState.WAITING
        self.waiting.append(request)  # its place follows from its class and arrival
        plan.preempted.append(request)

    # ------------------------------------------------------------------ waiting

    def _plan_waiting(
        self,
        plan: StepPlan,
        budget: int,
        now: float,
        hold_back: bool,
        include: Callable[[Request], bool] = lambda r: True,
    ) -> int:
        """Admit from the (sorted) queue, those `include` takes, within `budget`; returns the budget left."""
        window = self._window() if hold_back else 0.0
        scheduled = {s.request.seq_id for s in plan.seqs}
        if plan.preempted:  # requeued by class and arrival, usually ahead of newer arrivals
            self.waiting.sort(key=lambda r: (self._rank(r, now), r.arrival_time, r.seq_id))
        while budget > 0 and len(plan.seqs) < self.limits.max_num_seqs:
            request = next((r for r in self.waiting if include(r)), None)
            if request is None:
                break
            if window > 0 and request.num_preemptions == 0 and now - request.arrival_time < window:
                break  # its prefill waits a little for company
            if not self._admit(request, plan, budget, scheduled):
                break
            budget -= plan.seqs[-1].num_new_tokens
            scheduled.add(request.seq_id)
        return budget

    def _admit(self, request: Request, plan: StepPlan, budget: int, scheduled: set[int]) -> bool:
        """Start `request`'s prefill in this plan, preempting lower classes if it needs room."""
        rank = request.params.priority
        while True:
            if len(self.running) < self.limits.max_num_seqs:
                # Its blocks were all freed on preemption (or it is new): start from the longest cached prefix.
                request.num_computed_tokens = self.blocks.match_prefix(
                    request.seq_id, request.all_token_ids()
                )
                num_new = min(request.num_unscheduled_tokens, budget, self.limits.prefill_chunk)
                new_blocks = self.blocks.allocate(request.seq_id, request.num_computed_tokens + num_new)
                if new_blocks is not None:
                    break
                self.blocks.free(request.seq_id)  # give the matched prefix back until it can run
                request.num_computed_tokens = 0
            victim = self._pick_victim(plan, scheduled, below_rank=rank)
            if victim is None:
                return False  # head of line waits; running sequences will free blocks and slots
            self._preempt(victim, plan)
            self.num_priority_preemptions += 1
        self.waiting.remove(request)
        if request.num_preemptions == 0:
            self.queued_prompt_tokens -= request.prompt_len
            request.num_cached_prompt_tokens = request.num_computed_tokens
            self.prompt_tokens_admitted += request.prompt_len
            self.prompt_tokens_cached += request.num_computed_tokens
        request.state = RequestState.RUNNING
        self.running.append(request)
        plan.seqs.append(_scheduled(request, num_new, new_blocks))
        return True

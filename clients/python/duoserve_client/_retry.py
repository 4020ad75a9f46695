"""Retry policy (exponential backoff with jitter) and the per-call deadline it must respect."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import grpc

# Only UNAVAILABLE means "the server did not take the request": not reachable, not ready,
# or lost its worker before answering. Everything else is either the caller's fault
# (INVALID_ARGUMENT), a deliberate refusal that retrying would worsen (RESOURCE_EXHAUSTED),
# or the caller's own limit (DEADLINE_EXCEEDED, CANCELLED).
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Up to ``retries`` extra attempts; the n-th waits ``min(max, initial * 2**n)`` scaled by [0.5, 1)."""

    retries: int = 3
    backoff_initial: float = 0.1
    backoff_max: float = 2.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff_initial < 0 or self.backoff_max < self.backoff_initial:
            raise ValueError(
                f"need 0 <= backoff_initial <= backoff_max, got {self.backoff_initial}, {self.backoff_max}"
            )

    def delay(self, attempt: int, code: grpc.StatusCode | None) -> float | None:
        """Seconds to wait before retrying after failed attempt ``attempt`` (0-based), or None to give up."""
        if code not in RETRYABLE_CODES or attempt >= self.retries:
            return None
        ceiling = min(self.backoff_max, self.backoff_initial * (2**attempt))
        # Jitter keeps many clients refused at the same moment from returning in lockstep.
        return ceiling * (0.5 + 0.5 * self.rng.random())


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute deadline on the monotonic clock; ``at`` is None when the call has none."""

    at: float | None

    @classmethod
    def after(cls, timeout: float | None) -> Deadline:
        """The deadline ``timeout`` seconds from now (None: no deadline)."""
        return cls(None if timeout is None else time.monotonic() + timeout)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def allows(self, delay: float) -> bool:
        """Whether waiting ``delay`` seconds still leaves time for another attempt."""
        return self.at is None or time.monotonic() + delay < self.at

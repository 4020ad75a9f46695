"""Settings shared by the sync and asyncio clients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from duoserve_client._retry import RetryPolicy

DEFAULT_TARGET = "localhost:50051"

# Health states worth waiting through while a server starts (it may register its
# service names only once the model is loaded).
NOT_YET_READY = frozenset({"UNKNOWN", "NOT_SERVING", "SERVICE_UNKNOWN"})


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What both clients are built from; validated on construction."""

    target: str
    timeout: float | None
    retry: RetryPolicy
    options: tuple[tuple[str, Any], ...]
    metadata: tuple[tuple[str, str], ...]

    @classmethod
    def build(
        cls,
        target: str,
        *,
        timeout: float | None,
        retries: int,
        backoff_initial: float,
        backoff_max: float,
        options: Sequence[tuple[str, Any]],
        metadata: Sequence[tuple[str, str]],
    ) -> ClientSettings:
        """Check the arguments and merge the caller's channel options over the defaults."""
        if not target:
            raise ValueError("target must be HOST:PORT, got an empty string")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        retry = RetryPolicy(retries=retries, backoff_initial=backoff_initial, backoff_max=backoff_max)
        # gRPC's own reconnect backoff (1 s growing to 120 s) would make a channel fail
        # fast for long after a refused connection, so our retries and readiness polling
        # would never see a server that has come up. Keep it on the retry policy's scale.
        merged: dict[str, Any] = {
            "grpc.initial_reconnect_backoff_ms": max(1, int(backoff_initial * 1000)),
            "grpc.min_reconnect_backoff_ms": max(1, int(backoff_initial * 1000)),
            "grpc.max_reconnect_backoff_ms": max(1, int(backoff_max * 1000)),
        }
        merged.update(dict(options))
        return cls(
            target=target,
            timeout=timeout,
            retry=retry,
            options=tuple(merged.items()),
            metadata=tuple(metadata),
        )

    def call_timeout(self, timeout: float | None) -> float | None:
        """A call's own timeout, else the client's default."""
        return self.timeout if timeout is None else timeout

"""Per-node circuit breakers.

A breaker counts consecutive request failures of one node (connect errors, timeouts, 5xx). At the
threshold it opens, and the routing table demotes the node to `unhealthy` so no request pays for the same
failure again. The health checker is the only way back: once `/health` answers, it takes the single
half-open slot (`try_half_open`) and sends one real one-token completion; success closes the breaker,
failure opens it again. Upstream 4xx answers are the client's fault and never touch a breaker.

    closed ──(threshold failures)──▶ open ──(try_half_open)──▶ half-open
      ▲                                ▲                          │
      └─────────────(success)──────────┼──────────────────────────┤
                                       └──(failure or reopen)─────┘
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(StrEnum):
    """The three states of a circuit breaker."""

    CLOSED = "closed"
    """Requests flow; failures are counted."""
    OPEN = "open"
    """Tripped; the node is not routable until a probe succeeds."""
    HALF_OPEN = "half_open"
    """One probe is in flight; its outcome closes or reopens the breaker."""


class CircuitBreaker:
    """A consecutive-failure circuit breaker for one node. Not thread-safe: use it from one event loop.

    Args:
        threshold: consecutive failures that open the breaker (≥ 1).

    Raises:
        ValueError: `threshold` is below 1.
    """

    __slots__ = ("consecutive_failures", "state", "threshold")

    def __init__(self, threshold: int = 3) -> None:
        if threshold < 1:
            raise ValueError("a circuit breaker threshold must be at least 1")
        self.threshold = threshold
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0

    def record_success(self) -> None:
        """A request or probe succeeded: close the breaker and reset the count."""
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0

    def record_failure(self) -> bool:
        """A request or probe failed.

        Returns:
            True when the breaker is open after this failure (it just tripped, the half-open probe failed,
            or it was already open).
        """
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN or self.consecutive_failures >= self.threshold:
            self.state = BreakerState.OPEN
        return self.state is BreakerState.OPEN

    def try_half_open(self) -> bool:
        """Claim the single half-open probe.

        Returns:
            True when the breaker was open and is now half-open: the caller must report the probe's outcome
            with `record_success`, `record_failure` or `reopen`. False when it is not open or a probe is
            already in flight.
        """
        if self.state is BreakerState.OPEN:
            self.state = BreakerState.HALF_OPEN
            return True
        return False

    def reopen(self) -> None:
        """Give the half-open slot back without counting a failure (the probe could not be run)."""
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.OPEN

    @property
    def is_open(self) -> bool:
        """True while open or half-open: the node must not get ordinary traffic."""
        return self.state is not BreakerState.CLOSED

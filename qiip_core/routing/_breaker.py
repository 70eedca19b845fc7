"""Per-node circuit breakers: a failure rate over a short window, and a half-open timer of their own.

A breaker watches the outcomes of requests to one node (connect errors, timeouts, broken answers and 5xx
answers are failures; 4xx answers are the client's and never count). Two rules keep a blip from becoming
an outage:

- **Concurrent failures are one signal.** Sixteen streams that hit the same few milliseconds of a refused
  listener are one event, not sixteen. A failure counts as a new signal only when its request started
  after the last counted failure; a request already in flight then failed for the same reason.
- **It opens on a rate, not a streak.** Within the last `window_s`, at least `min_failures` signals, and
  signals at least `failure_rate` of the outcomes (signals and successes).

An open breaker takes no ordinary traffic. After `open_s` (doubling after each failed trial, up to
`open_max_s`) it lets one trial request through on its own timer, never waiting for a health probe: the
trial's success closes it at once, its failure opens it again for twice as long. A trial abandoned without
an outcome (the client left) gives the slot back. The health checker may run the trial too: once
`/health` answers, it sends one real one-token completion.

A trial forced before the timer has run out (that recovery probe, or a request's last chance when every node of
its model is open) that fails leaves the timer as it was: the open period doubles once per period, not once per
request, so `Retry-After` never grows faster than time passes.

    closed ──(rate over the window)──▶ open ──(open_s passed: one trial)──▶ half-open
      ▲                                 ▲                                      │
      └────────────────(success)────────┼──────────────────────────────────────┤
                                        └──(failure: open_s doubles)───────────┘
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

__all__ = ["BreakerPolicy", "BreakerState", "CircuitBreaker"]


class BreakerState(StrEnum):
    """The three states of a circuit breaker."""

    CLOSED = "closed"
    """Requests flow; outcomes are counted."""
    OPEN = "open"
    """Tripped: no ordinary traffic until its timer lets a trial through."""
    HALF_OPEN = "half_open"
    """One trial (a request or a recovery probe) is in flight; its outcome closes or reopens the breaker."""


class BreakerPolicy:
    """When breakers open and how long they stay open (`[breaker]` settings).

    Args:
        min_failures: failure signals within `window_s` needed to open (≥ 1).
        failure_rate: the share of the window's outcomes that must be failure signals (0 < rate ≤ 1).
        window_s: the sliding window, in seconds.
        open_s: how long a breaker stays open before its first trial, in seconds.
        open_max_s: the longest open period, however many trials failed, in seconds.

    Raises:
        ValueError: a value out of range.
    """

    __slots__ = ("failure_rate", "min_failures", "open_max_s", "open_s", "window_s")

    def __init__(
        self,
        *,
        min_failures: int = 3,
        failure_rate: float = 0.5,
        window_s: float = 10.0,
        open_s: float = 1.0,
        open_max_s: float = 30.0,
    ) -> None:
        if min_failures < 1:
            raise ValueError("a circuit breaker's min_failures must be at least 1")
        if not 0 < failure_rate <= 1:
            raise ValueError("a circuit breaker's failure_rate must be above 0 and at most 1")
        if window_s <= 0 or open_s <= 0 or open_max_s < open_s:
            raise ValueError("a circuit breaker needs window_s > 0 and 0 < open_s <= open_max_s")
        self.min_failures = min_failures
        self.failure_rate = failure_rate
        self.window_s = window_s
        self.open_s = open_s
        self.open_max_s = open_max_s


class CircuitBreaker:
    """The breaker of one node. Not thread-safe: use it from one event loop.

    Args:
        policy: when it opens and for how long.
        clock: monotonic seconds (tests pass their own).

    Attributes:
        state: closed, open or half-open.
        consecutive_failures: failure signals since the last success (for operators).
        retry_at: while open, when the next trial may go (`clock` seconds).
        last_failure_at: when the last failure signal was counted (`clock` seconds), or None.
    """

    __slots__ = (
        "_clock",
        "_early",
        "_outcomes",
        "_trips",
        "consecutive_failures",
        "last_failure_at",
        "policy",
        "retry_at",
        "state",
    )

    def __init__(self, policy: BreakerPolicy | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or BreakerPolicy()
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.retry_at = 0.0
        self.last_failure_at: float | None = None
        # The window's outcomes in one-second buckets, oldest first: [second, successes, failure signals].
        self._outcomes: deque[list[int]] = deque()
        # Trips since the breaker last closed: the open period doubles with each.
        self._trips = 0
        # The trial in flight was forced before the timer ran out: its failure keeps the timer.
        self._early = False

    def record_success(self) -> None:
        """A request or trial succeeded: a breaker not closed closes at once."""
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._trips = 0
            self._outcomes.clear()
            return
        self._add(self._clock(), failure=False)

    def record_failure(self, started_at: float | None = None) -> bool:
        """A request or trial failed.

        Args:
            started_at: when the failed request was sent (`clock` seconds); a request sent before the last
                counted failure was concurrent with it and is the same signal. None counts it.

        Returns:
            True when the breaker is open after this failure (it just opened, its trial failed, or it was
            already open).
        """
        now = self._clock()
        if self.state is BreakerState.HALF_OPEN:
            self._count(now)
            if self._early:
                self.state = BreakerState.OPEN
            else:
                self._open(now)
            return True
        if self.state is BreakerState.OPEN:
            return True
        if started_at is not None and self.last_failure_at is not None and started_at < self.last_failure_at:
            return False
        self._count(now)
        self._add(now, failure=True)
        failures = sum(bucket[2] for bucket in self._outcomes)
        outcomes = failures + sum(bucket[1] for bucket in self._outcomes)
        if failures >= self.policy.min_failures and failures >= self.policy.failure_rate * outcomes:
            self._open(now)
            return True
        return False

    def trial_due(self) -> bool:
        """Whether an open breaker's timer lets a trial through now."""
        return self.state is BreakerState.OPEN and self._clock() >= self.retry_at

    def try_half_open(self, *, force: bool = False) -> bool:
        """Claim the single trial.

        Args:
            force: claim it before the timer has run out (a recovery probe after a good `/health`, or the
                last chance when every node of a model is open).

        Returns:
            True when the breaker was open (and its timer had run out, or `force`) and is now half-open:
            the caller must report the trial's outcome with `record_success`, `record_failure` or `reopen`. A forced
            trial's failure before the timer ran out leaves the timer as it was.
        """
        if self.state is BreakerState.OPEN:
            early = self._clock() < self.retry_at
            if force or not early:
                self.state = BreakerState.HALF_OPEN
                self._early = early
                return True
        return False

    def reopen(self) -> None:
        """Give the trial back without an outcome (the client left, the probe could not run): the next
        trial may go at once."""
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.OPEN
            self.retry_at = self._clock()

    @property
    def is_open(self) -> bool:
        """True while open or half-open: the node must not get ordinary traffic."""
        return self.state is not BreakerState.CLOSED

    def _count(self, now: float) -> None:
        self.consecutive_failures += 1
        self.last_failure_at = now

    def _add(self, now: float, *, failure: bool) -> None:
        outcomes = self._outcomes
        second = int(now)
        if outcomes and outcomes[-1][0] == second:
            bucket = outcomes[-1]
        else:
            bucket = [second, 0, 0]
            outcomes.append(bucket)
            horizon = now - self.policy.window_s
            while outcomes[0][0] + 1 <= horizon:
                outcomes.popleft()
        bucket[2 if failure else 1] += 1

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.retry_at = now + min(self.policy.open_s * 2**self._trips, self.policy.open_max_s)
        self._trips += 1

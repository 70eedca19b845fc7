"""The circuit breaker on a test clock: concurrent failures are one signal, a rate over a window opens it,
and its own timer lets one trial through."""

from __future__ import annotations

import pytest

from qiip_core.routing import BreakerPolicy, BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **policy: float) -> CircuitBreaker:
    return CircuitBreaker(BreakerPolicy(**policy), clock=clock)  # type: ignore[arg-type]


def test_failures_of_requests_in_flight_together_are_one_signal() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=3)
    # Sixteen requests sent at t=1000 all fail at t=1000.01: one blip.
    sent = clock.now
    clock.now += 0.01
    assert not any(b.record_failure(sent) for _ in range(16))
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 1


def test_failures_of_requests_sent_one_after_another_open_it() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=3)
    results = []
    for _ in range(3):
        sent = clock.now
        clock.now += 0.01
        results.append(b.record_failure(sent))
    assert results == [False, False, True] and b.state is BreakerState.OPEN and b.is_open


def test_a_low_failure_rate_keeps_it_closed() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=3, failure_rate=0.5)
    for _ in range(3):
        for _ in range(5):
            b.record_success()
        clock.now += 0.1
        b.record_failure()
    assert b.state is BreakerState.CLOSED  # 3 failures in 18 outcomes
    clock.now += 11  # the window has passed: old successes no longer dilute
    for _ in range(3):
        clock.now += 0.1
        b.record_failure()
    assert b.state is BreakerState.OPEN


def test_its_own_timer_lets_one_trial_through_and_doubles_after_a_failed_trial() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=1, open_s=1, open_max_s=3)
    b.record_failure()
    assert not b.trial_due() and not b.try_half_open()
    clock.now += 1
    assert b.trial_due() and b.try_half_open()
    assert b.state is BreakerState.HALF_OPEN and not b.try_half_open()  # one trial at a time
    assert b.record_failure() is True
    clock.now += 1.5
    assert not b.trial_due()  # now 2 s
    clock.now += 0.5
    assert b.try_half_open()
    b.record_failure()
    clock.now += 3  # capped at open_max_s
    assert b.try_half_open()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0
    b.record_failure()
    clock.now += 1  # closed again: the period starts over
    assert b.trial_due()


def test_forced_trials_that_fail_before_the_timer_leave_it_as_it_was() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=1, open_s=1, open_max_s=30)
    b.record_failure()
    due = b.retry_at
    # Every node of a model open: each request is a last-chance trial, and each fails.
    for _ in range(6):
        clock.now += 0.1
        assert b.try_half_open(force=True)
        assert b.record_failure() is True
    assert b.state is BreakerState.OPEN and b.retry_at == due and b.consecutive_failures == 7
    # The trial its own timer let through fails: then, and only then, the period doubles.
    clock.now = due
    assert b.try_half_open()
    b.record_failure()
    assert b.retry_at == clock.now + 2


def test_a_trial_given_back_may_go_again_at_once() -> None:
    clock = Clock()
    b = breaker(clock, min_failures=1)
    b.record_failure()
    assert b.try_half_open(force=True)
    b.reopen()
    assert b.state is BreakerState.OPEN and b.trial_due() and b.consecutive_failures == 1
    b.reopen()
    assert b.state is BreakerState.OPEN


def test_a_closed_breaker_has_no_trial_and_bad_policies_are_refused() -> None:
    assert CircuitBreaker().try_half_open(force=True) is False
    bad_policies: list[dict[str, float]] = [
        {"min_failures": 0},
        {"failure_rate": 0},
        {"failure_rate": 1.5},
        {"open_s": 5, "open_max_s": 1},
    ]
    for bad in bad_policies:
        with pytest.raises(ValueError):
            BreakerPolicy(**bad)  # type: ignore[arg-type]

from __future__ import annotations

import pytest

from qiip_core.routing import BreakerState, CircuitBreaker


def test_opens_at_threshold() -> None:
    breaker = CircuitBreaker(3)
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.state is BreakerState.OPEN and breaker.is_open


def test_one_half_open_probe_at_a_time() -> None:
    breaker = CircuitBreaker(1)
    breaker.record_failure()
    assert breaker.try_half_open() is True
    assert breaker.try_half_open() is False
    assert breaker.state is BreakerState.HALF_OPEN


def test_half_open_failure_reopens_and_success_closes() -> None:
    breaker = CircuitBreaker(2)
    breaker.record_failure()
    breaker.record_failure()
    breaker.try_half_open()
    assert breaker.record_failure() is True
    assert breaker.state is BreakerState.OPEN
    breaker.try_half_open()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.consecutive_failures == 0


def test_reopen_gives_the_probe_back_without_counting() -> None:
    breaker = CircuitBreaker(1)
    breaker.record_failure()
    breaker.try_half_open()
    breaker.reopen()
    assert breaker.state is BreakerState.OPEN and breaker.consecutive_failures == 1
    breaker.reopen()
    assert breaker.state is BreakerState.OPEN


def test_closed_breaker_cannot_go_half_open() -> None:
    breaker = CircuitBreaker()
    assert breaker.try_half_open() is False
    with pytest.raises(ValueError):
        CircuitBreaker(0)

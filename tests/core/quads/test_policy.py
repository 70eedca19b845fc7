"""The schedule policy, without a network: when QUADS takes a host back, what to tear down, the backoff."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from qiip_core.quads import (
    Backoff,
    QuadsHost,
    QuadsSnapshot,
    Reservation,
    backoff_delay,
    conflict_at,
    next_reservation,
    plan_teardowns,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
DAY = 86_400.0


def host(name: str) -> QuadsHost:
    return QuadsHost(name=name, gpu_vendor="NVIDIA", gpu_product="H100", gpu_count=8)


def reservation(name: str, start_h: float, end_h: float, rid: int = 1) -> Reservation:
    return Reservation(
        id=rid,
        host=name,
        start=NOW + timedelta(hours=start_h),
        end=NOW + timedelta(hours=end_h),
        cloud="cloud07",
        owner="bob",
        ticket="77",
    )


def snapshot(*reservations: Reservation, names: tuple[str, ...] = ("a", "b", "c"), busy: tuple[str, ...] = ()):
    """A poll at NOW: every host available over the day unless a reservation (or `busy`) says otherwise."""
    taken = {r.host for r in reservations if r.start < NOW + timedelta(days=1) and r.end > NOW} | set(busy)
    return QuadsSnapshot(
        fetched_at=NOW,
        lookahead_s=DAY,
        hosts={n: host(n) for n in names},
        available=frozenset(n for n in names if n not in taken),
        reservations={n: tuple(r for r in reservations if r.host == n) for n in names},
    )


def test_a_free_host_has_no_conflict_and_an_unknown_host_is_not_quads_to_take() -> None:
    snap = snapshot()
    assert conflict_at("a", snap, NOW, DAY) is None
    assert conflict_at("elsewhere", snap, NOW, DAY) is None


@pytest.mark.parametrize(
    ("start_h", "end_h", "lookahead_h", "expected_h"),
    [
        (3, 5, 24, 3),  # starts inside the window: its start
        (-1, 2, 24, 0),  # in force now: now
        (25, 30, 24, None),  # starts after the window
        (24, 30, 24, None),  # starts exactly at the window's end: QUADS' rule does not count it
        (-5, -1, 24, None),  # over already
        (1, 2, 0.5, None),  # a short lookahead does not reach it
    ],
)
def test_conflict_is_the_first_overlapping_reservations_start(
    start_h: float, end_h: float, lookahead_h: float, expected_h: float | None
) -> None:
    snap = snapshot(reservation("a", start_h, end_h))
    got = conflict_at("a", snap, NOW, lookahead_h * 3600)
    assert got == (None if expected_h is None else NOW + timedelta(hours=expected_h))


def test_an_unavailable_host_without_a_schedule_to_explain_it_conflicts_now() -> None:
    snap = snapshot(busy=("b",))
    assert conflict_at("b", snap, NOW + timedelta(minutes=5), DAY) == NOW + timedelta(minutes=5)


def test_an_unavailability_explained_by_a_reservation_that_has_ended_is_no_conflict() -> None:
    snap = snapshot(reservation("a", 0.5, 1))
    later = NOW + timedelta(hours=2)
    assert conflict_at("a", snap, later, 0.5 * 3600) is None


def test_next_reservation_is_the_one_in_force_or_the_next() -> None:
    early, late = reservation("a", -1, 1, 1), reservation("a", 5, 6, 2)
    assert next_reservation([late, early], NOW) == early
    assert next_reservation([late, early], NOW + timedelta(hours=2)) == late
    assert next_reservation([late, early], NOW + timedelta(hours=7)) is None


def test_backoff_doubles_up_to_its_cap() -> None:
    delays = [backoff_delay(n, initial_s=60, cap_s=3600) for n in range(10)]
    assert delays == [0, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
    assert backoff_delay(10_000, initial_s=60, cap_s=3600) == 3600


def test_plan_tears_down_managed_hosts_in_conflict_soonest_first_and_skips_busy_and_backing_off() -> None:
    snap = snapshot(reservation("a", 6, 8, 1), reservation("b", 2, 3, 2), reservation("c", 1, 2, 3))
    plans = plan_teardowns(["a", "b", "unknown"], snap, NOW, lookahead_s=DAY)
    assert [p.host for p in plans] == ["b", "a"]  # c is not a managed node; unknown is not QUADS'
    assert plans[0].conflict_at == NOW + timedelta(hours=2)
    assert "QUADS reserves b from 2026-03-01 14:00 UTC for cloud07 (owner bob, ticket 77)" in plans[0].reason

    backoff = Backoff()
    backoff.failed(NOW, "ssh refused", initial_s=60, cap_s=3600)
    assert [p.host for p in plan_teardowns(["a", "b"], snap, NOW, lookahead_s=DAY, backoffs={"b": backoff})] == ["a"]
    later = NOW + timedelta(seconds=60)
    retried = plan_teardowns(["a", "b"], snap, later, lookahead_s=DAY, backoffs={"b": backoff}, busy={"a"})
    assert [p.host for p in retried] == ["b"]


def test_a_backoff_counts_failures_and_says_when_to_retry() -> None:
    backoff = Backoff()
    assert backoff.ready(NOW)
    assert backoff.failed(NOW, "one", initial_s=10, cap_s=25) == 10
    assert not backoff.ready(NOW + timedelta(seconds=9)) and backoff.ready(NOW + timedelta(seconds=10))
    assert backoff.failed(NOW, "two", initial_s=10, cap_s=25) == 20
    assert backoff.failed(NOW, "three", initial_s=10, cap_s=25) == 25
    assert (backoff.failures, backoff.last_error) == (3, "three")

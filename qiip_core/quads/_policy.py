"""The schedule policy, in pure functions: when QUADS takes a host back, which managed nodes to tear down, and
how long to wait after a teardown failed. No network, no clock: every function is given `now`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from qiip_core.quads._models import QuadsHost, Reservation

__all__ = [
    "Backoff",
    "QuadsSnapshot",
    "Teardown",
    "backoff_delay",
    "conflict_at",
    "next_reservation",
    "overlaps",
    "plan_teardowns",
    "teardown_at",
]


@dataclass(frozen=True)
class QuadsSnapshot:
    """What one successful poll of QUADS read."""

    fetched_at: datetime
    """When the poll began (aware, UTC)."""
    lookahead_s: float
    """The window `available` was asked for: from `fetched_at`, this many seconds."""
    hosts: Mapping[str, QuadsHost]
    """Every host QUADS knows (broken, retired and GPU-less ones included), by normalised name."""
    available: frozenset[str]
    """The hosts QUADS kept free of every schedule over the window."""
    reservations: Mapping[str, Sequence[Reservation]] = field(default_factory=dict)
    """The current and future schedules of each GPU host and each host a node stands on, by start."""


def next_reservation(reservations: Iterable[Reservation], now: datetime) -> Reservation | None:
    """The reservation in force at `now`, or else the next to start; None when there is none."""
    live = [r for r in reservations if r.end > now]
    return min(live, key=lambda r: (r.start, r.id), default=None)


def overlaps(r: Reservation, start: datetime, end: datetime) -> bool:
    """True when `r` overlaps the window from `start` to `end`."""
    # QUADS' own rule (`is_host_available`): a schedule in force at the start, one in force at the end, or one
    # inside the window.
    return r.start <= start < r.end or r.start < end <= r.end or (start < r.start and end > r.end)


def conflict_at(host: str, snapshot: QuadsSnapshot, now: datetime, lookahead_s: float) -> datetime | None:
    """When QUADS takes `host` back within `lookahead_s` of `now`: the start of the first reservation overlapping
    the window (`now` if one is in force), or None while the host stays free throughout it (or QUADS does not know
    the host: it is not QUADS' to take).

    A host QUADS did not list as available over the polled window, with no reservation to say why, is taken as
    in conflict now: QUADS said no, and the safe reading of an unexplained no is at once. A host QUADS marks broken
    or retired is in conflict now.
    """
    known = snapshot.hosts.get(host)
    if known is None:
        return None
    if not known.usable:
        return now
    end = now + timedelta(seconds=lookahead_s)
    reservations = snapshot.reservations.get(host, ())
    starts = [max(r.start, now) for r in reservations if overlaps(r, now, end)]
    if starts:
        return min(starts)
    if host not in snapshot.available:
        polled_end = snapshot.fetched_at + timedelta(seconds=snapshot.lookahead_s)
        if not any(overlaps(r, snapshot.fetched_at, polled_end) for r in reservations):
            return now
    return None


def teardown_at(host: str, snapshot: QuadsSnapshot, now: datetime, lookahead_s: float) -> datetime | None:
    """When the enforcement tears a managed node on `host` down: `now` while QUADS takes the host back within the
    lookahead (`conflict_at`), else the moment the next reservation comes within it (its start less `lookahead_s`);
    None while QUADS lists no reservation and keeps the host available (or does not know the host)."""
    if host not in snapshot.hosts:
        return None
    if conflict_at(host, snapshot, now, lookahead_s) is not None:
        return now
    upcoming = next_reservation(snapshot.reservations.get(host, ()), now)
    if upcoming is None:
        return None
    return max(now, upcoming.start - timedelta(seconds=lookahead_s))


def backoff_delay(failures: int, *, initial_s: float, cap_s: float) -> float:
    """Seconds to wait after the `failures`-th consecutive failure: `initial_s`, doubled each time, at most
    `cap_s`."""
    if failures <= 0:
        return 0.0
    return min(cap_s, initial_s * 2.0 ** min(failures - 1, 62))


@dataclass
class Backoff:
    """A host's failed teardowns: how many in a row, the last error, and when the next attempt may start."""

    failures: int = 0
    next_attempt_at: datetime | None = None
    last_error: str | None = None

    def failed(self, now: datetime, error: str, *, initial_s: float, cap_s: float) -> float:
        """Count one more failure; returns the wait before the next attempt."""
        self.failures += 1
        self.last_error = error
        delay = backoff_delay(self.failures, initial_s=initial_s, cap_s=cap_s)
        self.next_attempt_at = now + timedelta(seconds=delay)
        return delay

    def ready(self, now: datetime) -> bool:
        return self.next_attempt_at is None or now >= self.next_attempt_at


@dataclass(frozen=True)
class Teardown:
    """A managed node to tear down, and why."""

    host: str
    conflict_at: datetime
    reservation: Reservation | None
    reason: str


def plan_teardowns(
    managed: Iterable[str],
    snapshot: QuadsSnapshot,
    now: datetime,
    *,
    lookahead_s: float,
    backoffs: Mapping[str, Backoff] | None = None,
    busy: Iterable[str] = (),
) -> list[Teardown]:
    """The managed nodes (by normalised host name) QUADS takes back within the lookahead, skipping hosts whose
    teardown already runs (`busy`) or waits out a backoff; sorted by conflict, soonest first."""
    backoffs = backoffs or {}
    skip = set(busy)
    plans: list[Teardown] = []
    for host in sorted(set(managed)):
        if host in skip:
            continue
        backoff = backoffs.get(host)
        if backoff is not None and not backoff.ready(now):
            continue
        at = conflict_at(host, snapshot, now, lookahead_s)
        if at is None:
            continue
        end = now + timedelta(seconds=lookahead_s)
        reservation = next(
            (r for r in snapshot.reservations.get(host, ()) if overlaps(r, now, end)),
            None,
        )
        known = snapshot.hosts.get(host)
        mark = known.unusable_reason() if known is not None else None
        plans.append(Teardown(host, at, reservation, _reason(host, at, reservation, now, lookahead_s, mark)))
    return sorted(plans, key=lambda t: (t.conflict_at, t.host))


def _reason(
    host: str, at: datetime, reservation: Reservation | None, now: datetime, lookahead_s: float, mark: str | None
) -> str:
    hours = lookahead_s / 3600
    window = f"{hours:g} h" if hours >= 1 else f"{lookahead_s:g} s"
    if mark is not None:
        return f"QUADS marks {host} {mark}: tearing the node down, as for a reservation"
    if reservation is None:
        return (
            f"QUADS does not keep {host} available for the next {window} (no schedule says why): "
            "tearing the node down to give the host back"
        )
    when = "now" if reservation.start <= now else f"from {reservation.start.strftime('%Y-%m-%d %H:%M UTC')}"
    return (
        f"QUADS reserves {host} {when} for {reservation.describe()}, within the lookahead of {window}: "
        "tearing the node down before the reservation starts"
    )

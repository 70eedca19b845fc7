"""The QUADS poller: reads hosts, availability and schedules on an interval, and keeps the last good read
through outages, saying how old it is.

Each failed poll is one log line (never a traceback: a broken server is not a bug here). A host list that comes
back empty after a non-empty one is not believed at once (a QUADS restarting, or a database being restored, answers
so for a while, and believing it would protect nothing): the last read stays until the next poll says the same."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from qiip_core._errors import QuadsUnavailable, safe_text
from qiip_core.quads._client import QuadsClient
from qiip_core.quads._models import QuadsHost, Reservation, normalise_host
from qiip_core.quads._policy import QuadsSnapshot

__all__ = ["Clock", "QuadsPoller", "utc_now"]

logger = logging.getLogger("qiip.quads")

Clock = Callable[[], datetime]
"""The time now, aware (UTC)."""


def utc_now() -> datetime:
    return datetime.now(UTC)


class QuadsPoller:
    """Polls one QUADS server.

    Args:
        client: the QUADS client.
        lookahead_s: the availability window asked for at each poll.
        interval_s: seconds between polls.
        clock: the time now (tests move it).
        concurrency: schedule requests in flight at once.
        watched: the names of hosts whose schedules are read even without a GPU listed (the nodes: QUADS' word on
            their hosts is enforced whatever it lists); None: the GPU hosts only.
    """

    def __init__(
        self,
        client: QuadsClient,
        *,
        lookahead_s: float,
        interval_s: float,
        clock: Clock = utc_now,
        concurrency: int = 8,
        watched: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        self.client = client
        self.lookahead_s = lookahead_s
        self.interval_s = interval_s
        self.clock = clock
        self.watched = watched
        self._limit = asyncio.Semaphore(concurrency)
        self.unconfirmed_empty = False
        """The last poll listed no host after a non-empty read: the next one must say so too to be believed."""
        self.snapshot: QuadsSnapshot | None = None
        """The last good read; kept when a poll fails."""
        self.last_error: str | None = None
        """Why the last poll failed; None after a good one."""
        self.last_attempt_at: datetime | None = None
        self.polled = asyncio.Event()
        """Set after each poll, good or not (tests and the first enforcement wait on it)."""

    def age_s(self, now: datetime | None = None) -> float | None:
        """Seconds since the last good read began; None before the first."""
        if self.snapshot is None:
            return None
        return max(0.0, ((now or self.clock()) - self.snapshot.fetched_at).total_seconds())

    def stale(self, now: datetime | None = None) -> bool:
        """True with no data, after a failed poll, or when the data is older than two intervals."""
        age = self.age_s(now)
        return age is None or self.last_error is not None or age > 2 * self.interval_s

    def view(self, now: datetime | None = None) -> dict[str, Any]:
        """`{fetched_at, age_s, stale, last_error, last_attempt_at, hosts}`: how fresh QIIP's view of QUADS is."""
        now = now or self.clock()
        age = self.age_s(now)
        return {
            "fetched_at": self.snapshot.fetched_at.isoformat() if self.snapshot else None,
            "age_s": round(age, 3) if age is not None else None,
            "stale": self.stale(now),
            "last_error": self.last_error,
            "last_attempt_at": self.last_attempt_at.isoformat() if self.last_attempt_at else None,
            "hosts": sum(1 for h in self.snapshot.hosts.values() if h.lendable) if self.snapshot else 0,
        }

    async def poll(self) -> QuadsSnapshot:
        """Read QUADS once; on success the read replaces the kept one.

        Raises:
            QuadsUnavailable: QUADS could not be read (the kept read stays, and `last_error` says why).
        """
        now = self.clock()
        self.last_attempt_at = now
        try:
            hosts = await self.client.hosts()
            if not hosts and self.snapshot is not None and self.snapshot.hosts and not self.unconfirmed_empty:
                self.unconfirmed_empty = True
                raise QuadsUnavailable(
                    f"QUADS lists no host after listing {len(self.snapshot.hosts)}; the last read is kept until the "
                    "next poll confirms it."
                )
            self.unconfirmed_empty = False
            available = await self.client.available(start=now, end=now + timedelta(seconds=self.lookahead_s))
            watched = {normalise_host(name) for name in (self.watched() if self.watched is not None else ())}
            read = [h for h in hosts if h.lendable or h.name in watched]
            reservations = await asyncio.gather(*(self._reservations(h, now) for h in read))
        except QuadsUnavailable as exc:
            logger.warning("QUADS poll failed, keeping the last good data: %s", exc.message)
            self.last_error = exc.message
            self.polled.set()
            raise
        if self.last_error is not None:
            logger.info("QUADS answers again: %d host(s)", len(hosts))
        self.snapshot = QuadsSnapshot(
            fetched_at=now,
            lookahead_s=self.lookahead_s,
            hosts={h.name: h for h in hosts},
            available=frozenset(available),
            reservations={h.name: tuple(r) for h, r in zip(read, reservations, strict=True)},
        )
        self.last_error = None
        self.polled.set()
        return self.snapshot

    async def _reservations(self, host: QuadsHost, now: datetime) -> list[Reservation]:
        async with self._limit:
            return await self.client.reservations(host.name, now=now, quads_name=host.quads_name or None)

    async def run(self) -> None:
        """Poll every `interval_s` until cancelled; failures are logged and kept in `last_error`."""
        while True:
            try:
                await self.poll()
            except QuadsUnavailable:
                pass  # kept in last_error, logged
            except Exception as exc:  # a bug must not end the polling: the enforcement depends on it
                self.last_error = f"internal error: {type(exc).__name__}: {safe_text(str(exc), limit=300)}"
                logger.error("QUADS poll failed unexpectedly, keeping the last good data: %s", self.last_error)
                self.polled.set()
            await asyncio.sleep(self.interval_s)

"""The poller against the QUADS test server: it keeps the last good data while QUADS is down, says how old it
is, and takes fresh data again when QUADS is back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from qiip_core import QuadsUnavailable
from qiip_core.quads import QuadsClient, QuadsPoller
from tests.support.quads import QuadsServer


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


async def test_quads_down_then_back_keeps_the_last_data_reports_its_age_and_recovers(quads: QuadsServer) -> None:
    assert quads.now is not None
    clock = Clock(quads.now)
    quads.add_host("gpu01", gpus=8)
    quads.add_host("gpu02", gpus=4)
    quads.reserve("gpu02", quads.now + timedelta(hours=3), quads.now + timedelta(hours=9))
    client = QuadsClient(quads.url, "UTC", timeout_s=2)
    poller = QuadsPoller(client, lookahead_s=86_400, interval_s=300, clock=clock)
    try:
        assert poller.age_s() is None and poller.stale()
        first = await poller.poll()
        assert set(first.hosts) == {"gpu01", "gpu02"}
        assert first.available == {"gpu01"}
        assert [r.start for r in first.reservations["gpu02"]] == [quads.now + timedelta(hours=3)]
        assert poller.view()["age_s"] == 0 and not poller.stale()

        quads.stop()
        clock.now += timedelta(minutes=7)
        with pytest.raises(QuadsUnavailable, match="cannot be reached"):
            await poller.poll()
        assert poller.snapshot is first  # the last good data stays
        view = poller.view()
        assert view["age_s"] == 420 and view["stale"] and "cannot be reached" in view["last_error"]
        assert view["fetched_at"] == first.fetched_at.isoformat() and view["hosts"] == 2

        quads.start()
        quads.add_host("gpu03", gpus=2)
        clock.now += timedelta(minutes=1)
        again = await poller.poll()
        assert set(again.hosts) == {"gpu01", "gpu02", "gpu03"}
        assert poller.age_s() == 0 and poller.last_error is None and not poller.stale()
        clock.now += timedelta(minutes=11)
        assert poller.stale()  # older than two intervals
    finally:
        await client.aclose()


async def test_the_poll_asks_for_the_lookahead_window_in_server_time() -> None:
    now = datetime(2026, 11, 1, 4, 0, tzinfo=UTC)  # 00:00 EDT; the day ends after the fall-back hour
    with QuadsServer(timezone="America/New_York", now=now) as quads:
        quads.add_host("gpu01")
        client = QuadsClient(quads.url, "America/New_York")
        try:
            await QuadsPoller(client, lookahead_s=86_400, interval_s=60, clock=lambda: now).poll()
        finally:
            await client.aclose()
        # 24 h later is 23:00 EST the same day: one local hour was lived twice.
        assert quads.queries("/available") == [{"start": "2026-11-01T00:00", "end": "2026-11-01T23:00", "cloud": ""}]

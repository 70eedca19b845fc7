"""The poller against the QUADS test server: it keeps the last good data while QUADS is down, says how old it
is, and takes fresh data again when QUADS is back."""

from __future__ import annotations

import asyncio
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
    client = QuadsClient(quads.url, "UTC", timeout_s=30)
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


async def test_a_hostile_answer_is_refused_past_the_size_cap_while_it_is_read() -> None:
    sent = [0]

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b'"gpu", ' * 9_000
        try:
            while sent[0] < 1 << 30:  # a gigabyte, never declared
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent[0] += len(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(flood, "127.0.0.1", 0)
    client = QuadsClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "UTC", max_answer_bytes=1 << 20)
    try:
        with pytest.raises(QuadsUnavailable, match="answered /hosts with more than 1,048,576 bytes; it was not read"):
            await client.hosts()
        assert sent[0] < 64 << 20  # the gateway stopped reading: the server could not push the rest
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_requests_in_flight_are_bounded_whoever_asks(quads: QuadsServer) -> None:
    assert quads.now is not None
    for index in range(24):
        quads.add_host(f"gpu{index:02d}", gpus=2)
    quads.delay_s = 0.02
    client = QuadsClient(quads.url, "UTC", max_concurrent=3)
    poller = QuadsPoller(client, lookahead_s=86_400, interval_s=300, clock=lambda: quads.now)  # type: ignore[arg-type,return-value]
    try:
        snapshot = await poller.poll()
        await asyncio.gather(*(client.reservations(f"gpu{i:02d}") for i in range(8)))
    finally:
        await client.aclose()
    assert len(snapshot.reservations) == 24
    assert len(quads.requests) == 2 + 2 * 24 + 2 * 8 and quads.max_in_flight == 3


async def test_each_failed_poll_is_one_log_line_and_an_empty_host_list_waits_for_a_second_read(
    quads: QuadsServer, caplog: pytest.LogCaptureFixture
) -> None:
    assert quads.now is not None
    quads.add_host("gpu01", gpus=8)
    quads.add_host("gpu02", gpus=4)
    client = QuadsClient(quads.url, "UTC", timeout_s=30)
    poller = QuadsPoller(client, lookahead_s=86_400, interval_s=300, clock=lambda: quads.now)  # type: ignore[arg-type,return-value]
    try:
        first = await poller.poll()
        quads.stop()
        caplog.clear()
        for _ in range(3):
            with pytest.raises(QuadsUnavailable):
                await poller.poll()
        failed = [r for r in caplog.records if r.name == "qiip.quads"]
        assert len(failed) == 3 and all(r.exc_info is None and "\n" not in r.getMessage() for r in failed)
        quads.start()

        quads.hosts.clear()  # QUADS answers, listing nothing (a restore in progress, a restart)
        with pytest.raises(QuadsUnavailable, match="lists no host after listing 2; the last read is kept"):
            await poller.poll()
        assert poller.snapshot is first and poller.stale()
        empty = await poller.poll()  # said twice: believed
        assert empty.hosts == {} and poller.last_error is None
    finally:
        await client.aclose()

"""The QUADS client over HTTP against the QUADS test server: hosts, availability across DST changes, schedules,
and failures as `QuadsUnavailable`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from qiip_core import QuadsUnavailable
from qiip_core.quads import QuadsClient, parse_rfc1123, server_time, to_utc
from tests.support.daemon import free_port
from tests.support.quads import QuadsServer, rfc1123

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


async def test_hosts_keeps_every_host_with_its_first_gpu_and_whether_it_is_broken_or_retired(
    quads: QuadsServer,
) -> None:
    quads.add_host("GPU01.Lab.Example.", gpus=8, vendor="NVIDIA", product="H100 80GB HBM3")
    quads.add_host("gpu02.lab.example", gpus=2, vendor="AMD", product="MI300X", cloud=None)
    quads.add_host("cpu01.lab.example", gpus=0)
    quads.add_host("gpu03.lab.example", broken=True)
    quads.add_host("gpu04.lab.example", retired=True)
    client = QuadsClient(quads.url, "UTC")
    try:
        hosts = await client.hosts()
    finally:
        await client.aclose()
    assert [(h.name, h.gpu_vendor, h.gpu_product, h.gpu_count, h.cloud, h.unusable_reason()) for h in hosts] == [
        ("cpu01.lab.example", None, None, 0, "cloud01", None),
        ("gpu01.lab.example", "NVIDIA", "H100 80GB HBM3", 8, "cloud01", None),
        ("gpu02.lab.example", "AMD", "MI300X", 2, None, None),
        ("gpu03.lab.example", "NVIDIA", "H100 80GB HBM3", 4, "cloud01", "broken"),
        ("gpu04.lab.example", "NVIDIA", "H100 80GB HBM3", 4, "cloud01", "retired"),
    ]
    # A setup may use only the GPU hosts neither broken nor retired.
    assert [h.name for h in hosts if h.lendable] == ["gpu01.lab.example", "gpu02.lab.example"]


@pytest.mark.parametrize(
    ("deadline", "sent"),
    [
        # Spring forward (2026-03-08, 02:00 EST -> 03:00 EDT): a UTC minute apart, an hour apart locally.
        (datetime(2026, 3, 8, 6, 59, tzinfo=UTC), "2026-03-08T01:59"),
        (datetime(2026, 3, 8, 7, 0, tzinfo=UTC), "2026-03-08T03:00"),
        # Fall back (2026-11-01, 02:00 EDT -> 01:00 EST): two UTC hours give the same local time.
        (datetime(2026, 11, 1, 5, 30, tzinfo=UTC), "2026-11-01T01:30"),
        (datetime(2026, 11, 1, 6, 30, tzinfo=UTC), "2026-11-01T01:30"),
        (datetime(2026, 11, 1, 7, 30, tzinfo=UTC), "2026-11-01T02:30"),
        (datetime(2026, 7, 1, 16, 0, tzinfo=UTC), "2026-07-01T12:00"),
    ],
)
async def test_available_sends_the_deadline_in_the_servers_local_time_across_dst(deadline: datetime, sent: str) -> None:
    with QuadsServer(timezone="America/New_York", now=deadline - timedelta(hours=1)) as quads:
        quads.add_host("gpu01")
        client = QuadsClient(quads.url, "America/New_York")
        try:
            assert await client.available(start=deadline - timedelta(days=1), end=deadline) == {"gpu01"}
        finally:
            await client.aclose()
        [query] = quads.queries("/available")
        assert query["end"] == sent and query["cloud"] == ""


async def test_availability_and_schedules_agree_across_the_spring_forward() -> None:
    tz = "America/New_York"
    with QuadsServer(timezone=tz, now=datetime(2026, 3, 8, 5, 0, tzinfo=UTC)) as quads:
        quads.add_host("gpu01")
        # 03:00-04:00 EDT on the day clocks go forward: 07:00-08:00 UTC.
        quads.reserve("gpu01", datetime(2026, 3, 8, 7, 0, tzinfo=UTC), datetime(2026, 3, 8, 8, 0, tzinfo=UTC))
        client = QuadsClient(quads.url, tz)
        try:
            start = datetime(2026, 3, 8, 5, 0, tzinfo=UTC)
            assert await client.available(start=start, end=datetime(2026, 3, 8, 6, 59, tzinfo=UTC)) == {"gpu01"}
            assert await client.available(start=start, end=datetime(2026, 3, 8, 7, 1, tzinfo=UTC)) == set()
            [reservation] = await client.reservations("gpu01", now=start)
        finally:
            await client.aclose()
    assert reservation.start == datetime(2026, 3, 8, 7, 0, tzinfo=UTC)
    assert reservation.end == datetime(2026, 3, 8, 8, 0, tzinfo=UTC)
    assert (reservation.cloud, reservation.owner, reservation.ticket) == ("cloud02", "alice", "4242")


def test_a_cloud_given_by_name_alone_is_read_too() -> None:
    from qiip_core.quads._models import WireHost, WireSchedule

    host = WireHost.model_validate({"name": "h", "cloud": "cloud03", "processors": [{"processor_type": "GPU"}]})
    assert host.cloud is not None and host.cloud.name == "cloud03"
    schedule = WireSchedule.model_validate(
        {"id": 1, "start": "Mon, 01 Jun 2026 12:30:00 GMT", "end": "2026-06-02T12:30:00", "assignment": {"cloud": "c"}}
    )
    assert schedule.assignment is not None and schedule.assignment.cloud is not None
    assert schedule.end == datetime(2026, 6, 2, 12, 30)


def test_rfc1123_dates_are_the_servers_wall_clock_and_the_ambiguous_hour_reads_as_its_first() -> None:
    from zoneinfo import ZoneInfo

    tz = ZoneInfo("America/New_York")
    naive = parse_rfc1123("Sun, 01 Nov 2026 01:30:00 GMT")
    assert naive == datetime(2026, 11, 1, 1, 30)
    assert to_utc(naive, tz) == datetime(2026, 11, 1, 5, 30, tzinfo=UTC)  # EDT, the first 01:30
    assert to_utc(datetime(2026, 1, 15, 9, 0), tz) == datetime(2026, 1, 15, 14, 0, tzinfo=UTC)
    assert rfc1123(datetime(2024, 7, 2, 22, 0)) == "Tue, 02 Jul 2024 22:00:00 GMT"
    with pytest.raises(ValueError, match="naive"):
        server_time(datetime(2026, 1, 1), tz)


async def test_available_follows_quads_overlap_rules_and_the_start_after_end_rule(quads: QuadsServer) -> None:
    for name in ("a", "b", "c", "d"):
        quads.add_host(name)
    quads.add_host("broken", broken=True)
    quads.reserve("a", NOW + timedelta(hours=1), NOW + timedelta(hours=3))  # starts inside the window
    quads.reserve("b", NOW - timedelta(hours=1), NOW + timedelta(minutes=30))  # in force at the start
    quads.reserve("c", NOW + timedelta(hours=2), NOW + timedelta(hours=2, minutes=30))  # inside
    quads.reserve("d", NOW + timedelta(hours=4), NOW + timedelta(hours=5))  # after
    client = QuadsClient(quads.url, "UTC")
    try:
        assert await client.available(start=NOW, end=NOW + timedelta(hours=4)) == {"d"}
        # A start after the end: QUADS takes end = start + 1 minute.
        assert await client.available(start=NOW + timedelta(hours=6), end=NOW) == {"a", "b", "c", "d"}
    finally:
        await client.aclose()


async def test_reservations_merge_current_and_future_and_an_unknown_host_has_none(quads: QuadsServer) -> None:
    quads.add_host("gpu01")
    quads.add_host("gpu02")
    current = quads.reserve("gpu01", NOW - timedelta(days=1), NOW + timedelta(hours=1), owner="carol")
    future = quads.reserve("gpu01", NOW + timedelta(days=2), NOW + timedelta(days=3), cloud="cloud09")
    quads.reserve("gpu02", NOW + timedelta(days=1), NOW + timedelta(days=2))
    client = QuadsClient(quads.url, "UTC")
    try:
        found = await client.reservations("GPU01.", now=NOW)
        assert await client.reservations("nowhere", now=NOW) == []
    finally:
        await client.aclose()
    assert [(r.id, r.host, r.owner, r.cloud) for r in found] == [
        (current, "gpu01", "carol", "cloud02"),
        (future, "gpu01", "alice", "cloud09"),
    ]
    assert found[0].view()["assignment"] == "perf lab run"
    assert {"host": "gpu01", "date": "2026-06-01T12:00"} in quads.queries("/schedules/current")


async def test_failures_are_quads_unavailable_with_the_servers_message(quads: QuadsServer) -> None:
    client = QuadsClient(quads.url + "/api/v3", "UTC")  # /api/v3/api/v3/hosts: QUADS' own 404
    try:
        with pytest.raises(QuadsUnavailable, match=r"refused /hosts \(404: The requested URL"):
            await client.hosts()
    finally:
        await client.aclose()
    down = QuadsClient(f"http://127.0.0.1:{free_port()}", "UTC", timeout_s=2)
    try:
        with pytest.raises(QuadsUnavailable, match="cannot be reached") as info:
            await down.available(start=NOW, end=NOW)
        assert info.value.status == 503 and info.value.code == "quads_unavailable"
    finally:
        await down.aclose()


def test_the_test_server_answers_available_for_one_host_and_errors_as_quads_does(quads: QuadsServer) -> None:
    import httpx

    quads.add_host("gpu01")
    quads.reserve("gpu01", NOW + timedelta(minutes=30), NOW + timedelta(hours=1))
    api = quads.url + "/api/v3"
    with httpx.Client(trust_env=False) as http:
        assert http.get(api + "/available/gpu01").json() == {"gpu01": "True"}  # now: before the reservation
        later = {"start": "2026-06-01T12:29", "end": "2026-06-01T12:45"}  # QUADS adds a minute to the start here
        assert http.get(api + "/available/gpu01", params=later).json() == {"gpu01": "False"}
        assert http.get(api + "/available/nowhere").json() == {"nowhere": "False"}
        bad = http.get(api + "/available", params={"end": "tomorrow"})
        assert bad.status_code == 400 and bad.json() == {
            "status_code": 400,
            "error": "Bad Request",
            "message": "Invalid date format for end, correct format: 'YYYY-MM-DDTHH:MM'",
        }
        missing = http.get(api + "/hosts/nowhere")
        assert missing.status_code == 400 and missing.json()["message"] == "Host not found: nowhere"
        [schedule] = http.get(api + "/schedules", params={"host": "gpu01"}).json()
        assert (
            schedule["start"] == "Mon, 01 Jun 2026 12:30:00 GMT"
            and schedule["assignment"]["cloud"]["name"] == "cloud02"
        )
        [host] = http.get(api + "/hosts").json()
        assert [p["processor_type"] for p in host["processors"]] == ["CPU", "GPU", "GPU", "GPU", "GPU"]

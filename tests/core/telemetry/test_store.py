"""The daemon's telemetry store: readings validated, aged by the daemon's clock, stale ones not exported."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from qiip_core.client import NodeInfo
from qiip_core.telemetry import (
    MAX_READING_BYTES,
    NodeTelemetry,
    TelemetryStore,
    decode_reading,
    encode_reading,
)
from tests.support.nvml_stub import STUB_GPUS

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def reading(node_id: str = "gpu01", at: datetime = T0, interval_s: float = 1.0) -> NodeTelemetry:
    return NodeTelemetry.model_validate(
        {"node_id": node_id, "hostname": "h", "read_at": at, "interval_s": interval_s, "gpus": list(STUB_GPUS)}
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_reading_crosses_the_wire_unchanged() -> None:
    original = reading()
    assert decode_reading(encode_reading(original), "gpu01") == original


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (b"[]", "not a JSON object"),
        (b"{", "not JSON"),
        (b'{"node_id": "gpu01"}', "read_at: Field required"),
        (b" " * (MAX_READING_BYTES + 1), "over the limit"),
    ],
)
def test_malformed_readings_are_refused(value: bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        decode_reading(value, "gpu01")


def test_a_reading_published_under_another_node_s_name_is_refused() -> None:
    with pytest.raises(ValueError, match="of node 'gpu02', published as 'gpu01'"):
        decode_reading(encode_reading(reading("gpu02")), "gpu01")


def test_out_of_range_values_are_refused() -> None:
    data = json.loads(encode_reading(reading()))
    data["gpus"][0]["utilization_percent"] = 101
    with pytest.raises(ValueError, match=r"gpus\.0\.utilization_percent"):
        decode_reading(json.dumps(data).encode(), "gpu01")


def test_readings_age_by_the_daemon_s_clock_and_go_stale() -> None:
    clock = Clock()
    store = TelemetryStore(expire_after_intervals=3, clock=clock)
    assert store.view("gpu01") is None
    assert store.put(reading()) is True
    clock.now += 2.0
    # The same reading polled again is not younger for it.
    assert store.put(reading()) is False
    view = store.view("gpu01")
    assert view is not None and view["age_s"] == 2.0 and view["stale"] is False
    assert view["read_at"] == "2026-12-01T12:00:00Z"
    assert [(node, age) for node, _, age in store.fresh_with_age()] == [("gpu01", 2.0)]
    clock.now += 1.5
    view = store.view("gpu01")
    assert view is not None and view["stale"] is True
    assert list(store.fresh_with_age()) == []
    assert store.put(reading(at=T0 + timedelta(seconds=4))) is True
    assert [node for node, _, _ in store.fresh_with_age()] == ["gpu01"]
    store.delete("gpu01")
    assert store.view("gpu01") is None and len(store) == 0


def test_a_reading_goes_stale_after_its_own_intervals_not_the_daemon_s() -> None:
    clock = Clock()
    store = TelemetryStore(expire_after_intervals=3, clock=clock)
    # An agent reading every 10 s: fresh for 30 s, though this daemon's own interval would say 3.
    store.put(reading(interval_s=10.0))
    clock.now += 29.0
    assert [node for node, _, _ in store.fresh_with_age()] == ["gpu01"]
    clock.now += 2.0
    view = store.view("gpu01")
    assert list(store.fresh_with_age()) == [] and view is not None and view["stale"] is True
    # Polled agents cannot be renewed faster than they are polled: the longer of the two counts.
    polled = TelemetryStore(expire_after_intervals=3, min_interval_s=5.0, clock=clock)
    polled.put(reading(interval_s=1.0))
    clock.now += 14.0
    assert [node for node, _, _ in polled.fresh_with_age()] == ["gpu01"]
    # A reading that claims to come once a year still goes stale after three hours.
    assert store.expiry_for(reading(interval_s=365 * 86400.0)) == 3 * 3600.0


def test_the_console_s_client_reads_the_view_back() -> None:
    store = TelemetryStore(expire_after_intervals=3, clock=Clock())
    store.put(reading())
    node = NodeInfo.model_validate(
        {"id": "gpu01", "endpoint": "http://127.0.0.1:1", "status": "healthy", "model": "m", "engine": "vllm"}
        | {"gpus_live": store.view("gpu01")}
    )
    assert node.gpus_live is not None and node.gpus_live.read_at == T0 and not node.gpus_live.stale
    assert [(g.memory_used_mib, g.memory_total_mib) for g in node.gpus_live.gpus] == [(20480, 81920), (0, 23034)]

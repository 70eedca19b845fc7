"""What a gateway measures of a model's traffic for the autoscaler, how gateways' measures add up, what a request
for a deployment nothing serves yet meets, and the table's wait for a routable node."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from qiip_core.config import load_settings
from qiip_core.deployments import (
    Demand,
    DemandMeter,
    EtcdDemandExchange,
    LocalDemandExchange,
    expected_models,
    merge_demands,
)
from qiip_core.deployments._demand import MAX_TTFT_SAMPLES, TTFT_WINDOW_S, demand_from_json, demand_to_json
from qiip_core.nodes import NodeStatus
from tests.core.deployments.test_controller import a_deployment
from tests.core.routing.test_admission import table_with
from tests.support.etcd import EtcdServer

T0 = 1_800_000_000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_a_snapshot_counts_in_flight_slots_queued_ttft_and_the_last_request() -> None:
    clock, table = Clock(), table_with("a", "b", model="coder")
    meter = DemandMeter(clock)
    a, b = table.get("a"), table.get("b")
    assert a is not None and b is not None
    a.slots, b.slots = (0, 4), (1, 2)
    held = [table.reserve("coder") for _ in range(3)]
    for ttft in range(1, 11):  # 1 … 10 s
        meter.finished("coder", float(ttft))
    meter.set_queued("worker-1", {"coder": 2})
    with meter.waiting("coder"):
        found = meter.snapshot(table, ["coder", "idle"])["coder"]
    assert (found.in_flight, found.queued, found.slots, found.ttft_p90_s) == (3, 3, 6, 9.0)
    assert found.last_request_at == datetime.fromtimestamp(T0, UTC)
    # An unhealthy node's slots do not count; its requests in flight still do.
    table.set_liveness("b", NodeStatus.UNHEALTHY)
    assert meter.snapshot(table, ["coder"])["coder"].slots == 4
    for reservation in held:
        reservation.release()
    meter.set_queued("worker-1", {})
    clock.now += 30
    quiet = meter.snapshot(table, ["coder"])["coder"]
    assert (quiet.in_flight, quiet.queued) == (0, 0)
    assert quiet.last_request_at == datetime.fromtimestamp(T0, UTC), "the last request, not now, once nothing waits"
    clock.now += TTFT_WINDOW_S
    assert meter.snapshot(table, ["coder"])["coder"].ttft_p90_s is None, "samples older than the window are dropped"
    assert meter.snapshot(table, ["idle"])["idle"] == Demand()


def test_the_meter_stays_bounded_whatever_the_traffic() -> None:
    meter = DemandMeter(Clock())
    for _ in range(MAX_TTFT_SAMPLES * 3):
        meter.finished("coder", 0.5)
    assert len(meter._ttft["coder"]) == MAX_TTFT_SAMPLES
    meter.finished("", 1.0)  # a request no model was named for
    assert "" not in meter._last_request


def test_gateways_add_their_requests_and_share_the_same_slots() -> None:
    early, late = datetime(2026, 12, 1, 9, tzinfo=UTC), datetime(2026, 12, 1, 10, tzinfo=UTC)
    one = {"coder": Demand(in_flight=3, queued=1, slots=8, ttft_p90_s=0.4, last_request_at=early)}
    two = {"coder": Demand(in_flight=2, queued=4, slots=8, ttft_p90_s=1.5, last_request_at=late), "chat": Demand()}
    merged = merge_demands([one, two])
    assert merged["coder"] == Demand(in_flight=5, queued=5, slots=8, ttft_p90_s=1.5, last_request_at=late)
    assert merged["chat"] == Demand()
    assert demand_from_json(demand_to_json(merged["coder"])) == merged["coder"]


def test_a_deployment_nothing_serves_yet_is_expected_by_the_table() -> None:
    zero = a_deployment(
        name="zero", replicas=0, autoscale={"min": 0, "max": 2, "mode": "active", "activation_timeout_s": 30.0}
    )
    starting = a_deployment(name="starting", replicas=2)
    stopped = a_deployment(name="stopped", replicas=0)
    recommend_only = a_deployment(name="shadow", replicas=0, autoscale={"min": 0, "max": 2, "mode": "recommend"})
    found = expected_models([zero, starting, stopped, recommend_only], {})
    assert found["zero"].wait_s == 30.0 and found["zero"].queue == 64 and "scales from zero" in found["zero"].why
    assert found["starting"].wait_s == 0 and found["starting"].retry_after_s == 10.0
    assert found["stopped"].retry_after_s is None and "0 replicas" in found["stopped"].why
    assert found["shadow"].wait_s == 0, "only an active autoscaler starts a replica on demand"
    deleting = zero.model_copy(update={"deleting": True})
    assert expected_models([deleting], {}) == {}


async def test_a_request_waits_for_a_routable_node_and_no_longer_than_asked() -> None:
    table = table_with("a", model="coder")
    assert table.routable("coder") and not table.routable("other")
    assert not await table.wait_routable("other", 0.05)
    table.set_liveness("a", NodeStatus.UNHEALTHY)
    waiter = asyncio.create_task(table.wait_routable("coder", 60))
    await asyncio.sleep(0)
    assert not waiter.done()
    table.set_liveness("a", NodeStatus.HEALTHY)
    assert await waiter
    assert not table._listeners, "the waiter's listener is removed"


async def test_the_embedded_registry_exchanges_nothing() -> None:
    exchange = LocalDemandExchange()
    await exchange.publish({"coder": Demand(in_flight=1)})
    assert await exchange.others() == []
    await exchange.aclose()


@pytest.fixture
def two_exchanges(etcd: EtcdServer, tmp_path: Path) -> Iterator[tuple[EtcdDemandExchange, EtcdDemandExchange]]:
    settings = load_settings(state_dir=tmp_path, registry={"backend": "etcd"}, etcd={"endpoints": [etcd.url]})
    yield EtcdDemandExchange(settings, "gw-a", ttl_s=5), EtcdDemandExchange(settings, "gw-b", ttl_s=5)


@pytest.mark.integration
async def test_gateways_read_each_others_demand_through_etcd(
    two_exchanges: tuple[EtcdDemandExchange, EtcdDemandExchange],
) -> None:
    one, two = two_exchanges
    await one.publish({"coder": Demand(in_flight=2, slots=4)})
    await two.publish({"coder": Demand(queued=3, slots=4)})
    assert await one.others() == [{"coder": Demand(queued=3, slots=4)}]
    await one.publish({"coder": Demand(in_flight=5, slots=4)})  # replaces, under the same lease
    assert await two.others() == [{"coder": Demand(in_flight=5, slots=4)}]
    await two.aclose()  # a gateway that stops withdraws its record
    assert await one.others() == []
    await one.aclose()

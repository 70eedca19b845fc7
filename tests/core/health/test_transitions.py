from __future__ import annotations

import pytest

from qiip_core.health import ProbeOutcome, apply_probe, classify_health
from qiip_core.nodes import Node, NodeStatus
from qiip_core.routing import BreakerPolicy, BreakerState, RoutingTable

LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, b'{"status":"ok"}', ProbeOutcome.OK),
        (200, b"", ProbeOutcome.OK),
        (503, LOADING, ProbeOutcome.LOADING),
        (503, b'{"error":"overloaded"}', ProbeOutcome.FAILED),
        (503, b"not json", ProbeOutcome.FAILED),
        (500, LOADING, ProbeOutcome.FAILED),
        (404, b"", ProbeOutcome.FAILED),
    ],
)
def test_classify(status: int, body: bytes, outcome: ProbeOutcome) -> None:
    assert classify_health(status, body) is outcome


def make(status: NodeStatus = NodeStatus.UNKNOWN) -> tuple[RoutingTable, str]:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=2))
    table.apply_put(Node(id="a", endpoint="http://127.0.0.1:1", model="m", status=status), source="test")
    return table, "a"


def probe(table: RoutingTable, outcome: ProbeOutcome, threshold: int = 3) -> bool:
    state = table.get("a")
    assert state is not None
    return apply_probe(
        table, state, outcome, error="e" if outcome is ProbeOutcome.FAILED else None, failure_threshold=threshold
    )


def status(table: RoutingTable) -> NodeStatus:
    state = table.get("a")
    assert state is not None
    return state.status


def test_ok_makes_unknown_and_unhealthy_nodes_healthy() -> None:
    table, _ = make()
    assert probe(table, ProbeOutcome.OK) is False
    assert status(table) is NodeStatus.HEALTHY
    table.set_liveness("a", NodeStatus.UNHEALTHY)
    probe(table, ProbeOutcome.OK)
    assert status(table) is NodeStatus.HEALTHY
    assert table.get("a").node.last_heartbeat is not None


def test_failures_demote_only_at_the_threshold() -> None:
    table, _ = make()
    probe(table, ProbeOutcome.OK)
    probe(table, ProbeOutcome.FAILED)
    probe(table, ProbeOutcome.FAILED)
    assert status(table) is NodeStatus.HEALTHY
    probe(table, ProbeOutcome.FAILED)
    assert status(table) is NodeStatus.UNHEALTHY
    probe(table, ProbeOutcome.OK)
    assert status(table) is NodeStatus.HEALTHY
    assert table.get("a").health_failures == 0


def test_loading_is_not_a_failure() -> None:
    table, _ = make()
    probe(table, ProbeOutcome.OK)
    for _ in range(10):
        probe(table, ProbeOutcome.LOADING)
    assert status(table) is NodeStatus.UNKNOWN
    assert table.get("a").health_failures == 0


def test_an_open_breaker_asks_for_a_recovery_probe() -> None:
    table, _ = make(NodeStatus.HEALTHY)
    table.record_failure("a", "x")
    table.record_failure("a", "x")
    # The breaker is the request path's: liveness stays the probes'.
    assert status(table) is NodeStatus.HEALTHY
    assert probe(table, ProbeOutcome.OK) is True
    state = table.get("a")
    assert state is not None
    state.breaker.try_half_open(force=True)
    assert state.breaker.state is BreakerState.HALF_OPEN
    assert probe(table, ProbeOutcome.OK) is False


def test_lifecycle_status_is_never_changed_by_probes() -> None:
    table, _ = make(NodeStatus.DRAINING)
    probe(table, ProbeOutcome.OK)
    assert status(table) is NodeStatus.DRAINING
    for _ in range(5):
        probe(table, ProbeOutcome.FAILED)
    assert status(table) is NodeStatus.DRAINING
    table.apply_put(Node(id="a", endpoint="http://127.0.0.1:1", model="m", status=NodeStatus.HEALTHY), source="test")
    assert status(table) is NodeStatus.UNHEALTHY

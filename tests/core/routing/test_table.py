from __future__ import annotations

import random
import time

import pytest

from qiip_core import ModelNotFound, ModelUnavailable, NoNodes
from qiip_core.nodes import Node, NodeCapabilities, NodeStatus
from qiip_core.routing import RECENT_ERRORS, BreakerPolicy, ChangeKind, ExpectedModel, RoutingTable, TableChange


def node(node_id: str, model: str = "m", status: NodeStatus = NodeStatus.HEALTHY, **kw: object) -> Node:
    return Node(id=node_id, endpoint=f"http://127.0.0.1:{8000 + len(node_id)}", model=model, status=status, **kw)


def table_with(*nodes: Node) -> RoutingTable:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=3), rng=random.Random(1))
    for n in nodes:
        table.apply_put(n, source="test")
    return table


def test_least_connections_prefers_idle_node() -> None:
    table = table_with(node("a"), node("b"))
    first = table.reserve("m")
    second = table.reserve("m")
    assert {first.node.id, second.node.id} == {"a", "b"}
    first.release()
    third = table.reserve("m")
    assert third.node.id == first.node.id


def test_ties_are_broken_at_random() -> None:
    table = table_with(node("a"), node("b"), node("c"))
    chosen = set()
    for _ in range(60):
        r = table.reserve("m")
        chosen.add(r.node.id)
        r.release()
    assert chosen == {"a", "b", "c"}


def test_model_names_are_opaque_and_exact() -> None:
    table = table_with(node("a", "org/Model:Q4_K_M"), node("b", "org/model:q4_k_m"))
    assert table.reserve("org/Model:Q4_K_M").node.id == "a"
    with pytest.raises(ModelNotFound):
        table.reserve("org/Model")


def test_routing_errors() -> None:
    with pytest.raises(NoNodes) as no_nodes:
        RoutingTable().reserve("m")
    assert (no_nodes.value.status, no_nodes.value.code) == (503, "no_nodes")
    table = table_with(node("a", status=NodeStatus.UNHEALTHY), node("b", model="other"))
    with pytest.raises(ModelNotFound) as missing:
        table.reserve("x")
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")
    with pytest.raises(ModelNotFound) as huge:
        table.reserve("x" * 1_000_000)
    assert len(huge.value.message) < 400 and "(1000000 characters)" in huge.value.message
    with pytest.raises(ModelUnavailable) as unavailable:
        table.reserve("m")
    assert (unavailable.value.status, unavailable.value.code) == (503, "model_unavailable")
    healthy = table_with(node("a"))
    with pytest.raises(ModelUnavailable):
        healthy.reserve("m", exclude=["a"])


def test_reservation_is_released_exactly_once() -> None:
    table = table_with(node("a"))
    reservation = table.reserve("m")
    state = table.get("a")
    assert state is not None and state.in_flight == 1
    reservation.release()
    reservation.release()
    with reservation:
        pass
    assert state.in_flight == 0


def test_only_healthy_closed_nodes_under_their_cap_are_eligible() -> None:
    capped = node("a", capabilities=NodeCapabilities(concurrency=1))
    table = table_with(capped, node("b", status=NodeStatus.DRAINING), node("c", status=NodeStatus.UNKNOWN))
    r = table.reserve("m")
    assert r.node.id == "a"
    with pytest.raises(ModelUnavailable):
        table.reserve("m")
    r.release()
    assert table.reserve("m").node.id == "a"


def test_delete_drains_until_the_last_request_ends() -> None:
    table = table_with(node("a"), node("b"))
    changes: list[TableChange] = []
    table.add_listener(changes.append)
    r = table.reserve("m", exclude=["b"])
    table.apply_delete("a")
    state = table.get("a")
    assert state is not None and state.status is NodeStatus.DRAINING
    other = table.reserve("m")
    assert other.node.id == "b"
    other.release()
    r.release()
    assert table.get("a") is None
    assert [c.kind for c in changes] == [ChangeKind.UPDATED, ChangeKind.REMOVED]
    table.apply_delete("b")
    assert len(table) == 0


def test_a_nodes_error_record_counts_repeats_keeps_the_newest_and_is_shared_with_the_breaker() -> None:
    table = table_with(node("a"))
    state = table.get("a")
    assert state is not None
    state.note_error("the node answered HTTP 500.", status=500)
    state.note_error("the node answered HTTP 500.", status=500)
    table.record_failure("a", "connection refused")
    with table.reserve("m") as reservation:
        reservation.note_error("the node answered HTTP 503.", status=503)
        reservation.record_failure("the node answered HTTP 503.", noted=True)  # counted, not noted twice
    views = state.error_views()
    assert [(v["status"], v["error"], v["count"]) for v in views] == [
        (503, "the node answered HTTP 503.", 1),
        (None, "connection refused", 1),
        (500, "the node answered HTTP 500.", 2),
    ]
    assert state.breaker.consecutive_failures == 2 and state.last_error == "the node answered HTTP 503."
    for n in range(RECENT_ERRORS + 5):
        state.note_error(f"error {n}")
    assert len(state.recent_errors) == RECENT_ERRORS and state.error_views()[0]["error"] == f"error {RECENT_ERRORS + 4}"


def test_an_open_breaker_keeps_ordinary_traffic_away_without_demoting_the_node() -> None:
    table = table_with(node("a"), node("b"))
    assert [table.record_failure("a", "boom") for _ in range(3)] == [False, False, True]
    state = table.get("a")
    assert state is not None and state.status is NodeStatus.HEALTHY and state.last_error == "boom"
    assert not state.eligible
    for _ in range(5):
        with table.reserve("m") as r:
            assert r.node.id == "b"


def test_a_success_closes_an_open_breaker_at_once() -> None:
    table = table_with(node("a"))
    for _ in range(3):
        table.record_failure("a", "x")
    table.record_success("a")
    state = table.get("a")
    assert state is not None and state.eligible


def test_when_every_breaker_is_open_the_node_that_failed_longest_ago_is_tried() -> None:
    table = table_with(node("a"), node("b"))
    for node_id in ("a", "b"):
        for _ in range(3):
            table.record_failure(node_id, "x")
    with table.reserve("m") as last_chance:
        assert last_chance.node.id == "a" and last_chance.trial
        # Its trial is out; the other one is tried next.
        with table.reserve("m") as second:
            assert second.node.id == "b"
    # Abandoned without an outcome: the trial is given back.
    state = table.get("a")
    assert state is not None and state.breaker.trial_due()
    assert table.retry_after_s("m") == 0.0


def test_a_model_expected_from_a_node_on_its_way_is_unavailable_not_missing() -> None:
    table = RoutingTable()
    table.expected = {"local": ExpectedModel("its local node a is starting", 5.0)}
    for model, kind in [("local", ModelUnavailable), ("other", NoNodes)]:
        with pytest.raises(kind) as refused:
            table.reserve(model)
        assert refused.value.retry_after_s == (5.0 if model == "local" else None)
    assert "not served yet: its local node a is starting" in table.routing_error("local").message
    table.apply_put(node("b", model="other"), source="test")
    assert isinstance(table.routing_error("elsewhere"), ModelNotFound)
    # Once registered, the node's own state speaks.
    table.apply_put(node("a", model="local", status=NodeStatus.UNKNOWN), source="test")
    assert "1 node: 1 unknown" in table.routing_error("local").message


def test_retry_after_is_when_a_node_can_next_be_tried_never_past_the_next_probe() -> None:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=1, open_s=5, open_max_s=600), probe_interval_s=2.0)
    table.apply_put(node("a"), source="test")
    table.record_failure("a", "refused")
    # Its breaker's trial is 5 s away, but a good health probe runs it within 2 s.
    assert table.retry_after_s("m") == 2.0
    # Requests' last chances that fail do not push it further.
    for _ in range(8):
        with table.reserve("m") as last_chance:
            last_chance.record_failure("refused")
    state = table.get("a")
    assert state is not None and state.breaker.retry_at - time.monotonic() <= 5
    assert table.retry_after_s("m") == 2.0
    table.apply_put(node("b", status=NodeStatus.UNKNOWN), source="test")
    assert table.retry_after_s("m") == 2.0  # b waits for its first probe
    table.record_success("a")
    table.set_liveness("b", NodeStatus.HEALTHY)
    assert table.retry_after_s("m") is None


def test_an_open_breaker_lets_one_trial_through_on_its_own_timer() -> None:
    table = RoutingTable(breaker=BreakerPolicy(min_failures=1, open_s=0.05))
    table.apply_put(node("a"), source="test")
    table.apply_put(node("b"), source="test")
    table.record_failure("a", "x")
    retry_after_s = table.retry_after_s("m")
    assert retry_after_s is not None and 0 < retry_after_s <= 0.05
    busy = table.reserve("m")
    assert busy.node.id == "b"
    time.sleep(0.06)
    trial = table.reserve("m")  # least connections: the idle node, due its trial
    assert trial.node.id == "a" and trial.trial
    with table.reserve("m") as ordinary:
        assert ordinary.node.id == "b"  # one trial at a time
    busy.release()
    trial.record_success()
    trial.release()
    state = table.get("a")
    assert state is not None and state.eligible and not state.breaker.is_open


def test_lifecycle_from_registry_wins_and_local_liveness_beats_registry_liveness() -> None:
    table = table_with(node("a", status=NodeStatus.UNKNOWN))
    table.set_liveness("a", NodeStatus.HEALTHY)
    table.apply_put(node("a", status=NodeStatus.UNHEALTHY), source="etcd")
    state = table.get("a")
    assert state is not None and state.status is NodeStatus.HEALTHY
    table.apply_put(node("a", status=NodeStatus.DRAINING), source="etcd")
    assert state.status is NodeStatus.DRAINING
    table.set_liveness("a", NodeStatus.HEALTHY)
    assert state.status is NodeStatus.DRAINING
    table.apply_put(node("a", status=NodeStatus.HEALTHY), source="etcd")
    assert state.status is NodeStatus.HEALTHY


def test_unobserved_node_takes_registry_liveness_and_endpoint_change_resets_observation() -> None:
    table = table_with(node("a", status=NodeStatus.HEALTHY))
    state = table.get("a")
    assert state is not None and state.status is NodeStatus.HEALTHY
    table.set_liveness("a", NodeStatus.UNHEALTHY)
    moved = node("a").model_copy(update={"endpoint": "http://127.0.0.1:9999", "status": NodeStatus.UNKNOWN})
    table.apply_put(moved, source="state")
    assert state.status is NodeStatus.UNKNOWN and not state.observed


def test_model_change_reindexes() -> None:
    table = table_with(node("a", "m1"))
    table.apply_put(node("a", "m2"), source="state")
    with pytest.raises(ModelNotFound):
        table.reserve("m1")
    assert table.reserve("m2").node.id == "a"
    assert table.models() == {"m2": table.get("a").node.engine}


def test_liveness_and_lifecycle_setters_refuse_the_wrong_kind() -> None:
    table = table_with(node("a"))
    with pytest.raises(ValueError):
        table.set_liveness("a", NodeStatus.DRAINING)
    with pytest.raises(ValueError):
        table.set_lifecycle("a", NodeStatus.HEALTHY)
    table.set_lifecycle("a", NodeStatus.DRAINING)
    assert table.get("a").status is NodeStatus.DRAINING
    table.set_lifecycle("a", None)
    assert table.get("a").status is NodeStatus.HEALTHY


def test_a_failing_listener_does_not_break_the_table() -> None:
    table = RoutingTable()

    def boom(change: TableChange) -> None:
        raise RuntimeError("listener bug")

    remove = table.add_listener(boom)
    table.apply_put(node("a"), source="test")
    remove()
    assert "a" in table


def test_reserve_by_api_skips_nodes_that_do_not_serve_it() -> None:
    from qiip_core import EndpointNotSupported

    chat_only = node("a", capabilities=NodeCapabilities(endpoints=("chat",)))
    table = table_with(chat_only, node("b", model="other"))
    assert table.reserve("m", api="chat").node.id == "a"
    with pytest.raises(EndpointNotSupported) as info:
        table.reserve("m", api="embeddings")
    assert info.value.status == 400 and "serve: chat" in info.value.message
    with pytest.raises(ModelNotFound):
        table.reserve("nope", api="embeddings")
    embed = node("c", capabilities=NodeCapabilities(endpoints=("embeddings",)), status=NodeStatus.UNHEALTHY)
    table.apply_put(embed, source="test")
    with pytest.raises(ModelUnavailable):
        table.reserve("m", api="embeddings")

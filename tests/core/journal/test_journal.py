"""The fleet journal over a real routing table and operation runner: what it records, and its bound."""

from __future__ import annotations

import asyncio
from typing import Any

from qiip_core.journal import Journal
from qiip_core.lifecycle import Operation, OperationRunner
from qiip_core.nodes import Node, NodeStatus
from qiip_core.routing import BreakerPolicy, RoutingTable


def node(node_id: str = "n1", status: NodeStatus = NodeStatus.UNKNOWN) -> Node:
    return Node(id=node_id, endpoint="http://127.0.0.1:9", model="m", status=status)


async def test_status_changes_carry_the_probe_reason_and_the_operation_behind_a_lifecycle() -> None:
    table, runner = RoutingTable(breaker=BreakerPolicy(min_failures=1)), OperationRunner()
    journal = Journal(table, runner)
    table.apply_put(node(), source="config")
    table.set_liveness("n1", NodeStatus.HEALTHY, reason="health probe ok")

    async def work(operation: Operation) -> dict[str, Any]:
        table.set_lifecycle("n1", NodeStatus.DRAINING)
        return {"remaining_in_flight": 0}

    operation = runner.start("drain", "n1", work)
    await asyncio.sleep(0.01)
    table.record_failure("n1", "connect error: refused")
    table.apply_delete("n1")
    events = [(e.event, e.summary, e.reason) for e in journal.entries()]
    assert events == [
        ("added", "added as unknown", "registered from config"),
        ("status", "unknown → healthy", "health probe ok"),
        ("operation_started", "drain started", None),
        ("status", "healthy → draining", f"drain operation {operation.id}"),
        ("operation_succeeded", "drain succeeded", "remaining_in_flight=0"),
        ("breaker_open", "circuit breaker opened", "connect error: refused"),
        ("removed", "removed from the fleet", "deregistered"),
    ]
    assert [e.seq for e in journal.entries()] == list(range(1, 8))
    journal.close()


async def test_the_journal_keeps_its_last_entries_and_followers_get_new_ones() -> None:
    table = RoutingTable()
    journal = Journal(table, OperationRunner(), max_entries=3)
    for index in range(5):
        journal.record(f"n{index}", "note", "hello")
    assert [e.node for e in journal.entries()] == ["n2", "n3", "n4"]
    with journal.follow() as (backlog, queue):
        assert len(backlog) == 3
        journal.record("n9", "note", "live")
        entry = queue.get_nowait()
        assert entry is not None and entry.node == "n9" and entry.view()["seq"] == 6
        journal.close()
        assert queue.get_nowait() is None

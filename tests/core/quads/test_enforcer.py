"""The enforcement loop's bookkeeping without a network: failed teardowns back off (doubling, capped) with the
reason on the host's log; a teardown that starts is not started twice; a success forgets the host."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from qiip_core import HostBusy
from qiip_core.config import QuadsSettings
from qiip_core.lifecycle import OperationRunner, OperationState
from qiip_core.nodes import Node
from qiip_core.provisioning import HostLogs
from qiip_core.quads import QuadsClient, QuadsEnforcer, QuadsHost, QuadsPoller, QuadsSnapshot, Reservation
from qiip_core.routing import RoutingTable

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


class StubProvisioner:
    """Refuses teardowns with HostBusy while `busy`, else runs one that ends as `outcome`."""

    def __init__(self, operations: OperationRunner) -> None:
        self.logs = HostLogs()
        self.operations = operations
        self.busy = True
        self.calls: list[tuple[str, str | None]] = []

    async def is_provisioned(self, node_id: str) -> bool:
        return node_id != "gpu-local"

    async def start_teardown(
        self, node_id: str, *, force: bool, reason: str | None = None, forget_host_key: bool = False
    ) -> Any:
        assert forget_host_key  # QUADS re-images the hosts it takes back
        self.calls.append((node_id, reason))
        if self.busy:
            raise HostBusy(f"Host {node_id} is busy with another operation.", host=node_id)

        async def work(op: Any) -> dict[str, Any]:
            return {}

        return self.operations.start("teardown", node_id, work)


async def test_failures_back_off_doubling_to_the_cap_then_a_success_forgets_the_host() -> None:
    table = RoutingTable()
    for node_id in ("gpu-a", "gpu-local", "gpu-b"):
        table.apply_put(Node(id=node_id, endpoint="http://127.0.0.1:8000", model="m", managed=True), source="etcd")
    table.apply_put(Node(id="gpu-c", endpoint="http://127.0.0.1:8000", model="m", managed=False), source="etcd")
    reserved = Reservation(id=1, host="gpu-a", start=NOW + timedelta(hours=2), end=NOW + timedelta(hours=5))
    hosts = {n: QuadsHost(name=n, gpu_vendor="NVIDIA", gpu_product="A100", gpu_count=4) for n in (s.id for s in table)}
    clock = Clock()
    client = QuadsClient("http://127.0.0.1:9", "UTC")  # never asked: the snapshot is given
    poller = QuadsPoller(client, lookahead_s=86_400, interval_s=300, clock=clock)
    poller.snapshot = QuadsSnapshot(
        fetched_at=NOW,
        lookahead_s=86_400,
        hosts=hosts,
        # gpu-local and gpu-c are unavailable with no schedule, but one is not provisioned and one not managed.
        available=frozenset({"gpu-b"}),
        reservations={"gpu-a": (reserved,)},
    )
    operations = OperationRunner()
    stub = StubProvisioner(operations)
    settings = QuadsSettings(url="http://127.0.0.1:9", timezone="UTC", backoff_initial_s=60, backoff_cap_s=200)
    enforcer = QuadsEnforcer(poller, stub, table, settings, clock=clock)  # type: ignore[arg-type]
    try:
        assert await enforcer.tick() == []
        assert [c[0] for c in stub.calls] == ["gpu-a"]
        assert enforcer.backoffs["gpu-a"].failures == 1
        log = [(e.level, e.msg) for e in stub.logs.entries("gpu-a")]
        assert log[0][0] == "warning" and log[0][1].startswith("QUADS reserves gpu-a from 2026-06-01 14:00 UTC")
        assert log[1] == (
            "error",
            "QUADS enforcement: the teardown of gpu-a failed (Host gpu-a is busy with another operation.); "
            "next attempt in 60 s",
        )

        waits = []
        for _ in range(3):
            due = enforcer.backoffs["gpu-a"].next_attempt_at
            assert due is not None
            clock.now = due - timedelta(seconds=1)
            await enforcer.tick()  # still backing off: not asked again
            clock.now = due
            await enforcer.tick()
            next_due = enforcer.backoffs["gpu-a"].next_attempt_at
            assert next_due is not None
            waits.append((next_due - clock.now).total_seconds())
        assert waits == [120, 200, 200]  # doubled, capped at 200
        assert len(stub.calls) == 4

        stub.busy = False
        clock.now += timedelta(seconds=200)
        [plan] = await enforcer.tick()
        assert plan.host == "gpu-a" and stub.calls[-1][1] == plan.reason
        operation = enforcer.running["gpu-a"]
        assert await enforcer.tick() == []  # running: not started twice
        async with asyncio.timeout(10):
            while operation.state is OperationState.RUNNING:  # noqa: ASYNC110 - the operation has no event
                await asyncio.sleep(0.01)
        assert operation.state is OperationState.SUCCEEDED
        table.apply_delete("gpu-a")
        assert await enforcer.tick() == []
        assert enforcer.backoffs == {} and enforcer.running == {}
    finally:
        await operations.aclose()
        await client.aclose()

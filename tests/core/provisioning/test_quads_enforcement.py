"""Schedule enforcement through the real provisioning path: a managed node set up over SSH on a loopback host is
drained and torn down when QUADS reserves its host within the lookahead (the QUADS test server over HTTP, its clock
and QIIP's under the test's control)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from qiip_core.config import QuadsSettings
from qiip_core.lifecycle import OperationState
from qiip_core.nodes import Engine
from qiip_core.provisioning import SetupRequest, TaskState
from qiip_core.quads import QuadsService
from tests.core.provisioning.conftest import Harness
from tests.support.quads import QuadsServer
from tests.support.sshd import SshHosts, alive

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


async def test_a_reservation_inside_the_lookahead_drains_and_tears_down_the_managed_node(
    harness: Harness, ssh_hosts: SshHosts
) -> None:
    host = ssh_hosts[5]
    setup = await harness.provisioner.start_setup(
        SetupRequest(hostname=host.address, engine=Engine.VLLM, model="org/model", alias="served-model")
    )
    assert (await harness.wait(setup)).state is OperationState.SUCCEEDED, setup.error
    engine_pid = host.engine_pid("vllm")
    assert engine_pid is not None and alive(engine_pid)

    start = datetime(2026, 3, 7, 12, 0, tzinfo=UTC)
    clock = Clock(start)
    with QuadsServer(timezone="America/New_York", now=start) as quads:
        quads.add_host(host.address.upper() + ".", gpus=2, product="L40S")  # QUADS' spelling, normalised by QIIP
        quads.add_host("gpu-spare.lab", gpus=8)
        reserved_at = start + timedelta(hours=20)  # 2026-03-08 08:00 UTC: after the spring-forward
        quads.reserve(host.address.upper() + ".", reserved_at, reserved_at + timedelta(days=2), owner="dana")
        settings = QuadsSettings(
            url=quads.url, timezone="America/New_York", lookahead_s=12 * 3600, backoff_initial_s=30
        )
        service = QuadsService(settings, harness.provisioner, harness.table, clock=clock)
        try:
            await service.poller.poll()
            assert await service.enforcer.tick() == []  # 20 h away, the lookahead is 12 h
            view = service.host_view(host.address)
            assert view is not None
            assert view["next_conflict_at"] == reserved_at.isoformat() and view["seconds_to_conflict"] == 72_000
            assert not view["conflict_within_lookahead"] and view["gpus"] == {
                "vendor": "NVIDIA",
                "product": "L40S",
                "count": 2,
            }
            assert view["next_reservation"]["owner"] == "dana"
            # The node is torn down one lookahead before the reservation, not at its start.
            assert view["teardown_at"] == (reserved_at - timedelta(hours=12)).isoformat()
            assert [e["id"] for e in service.unprovisioned([host.address])] == ["gpu-spare.lab"]

            clock.now = quads.now = start + timedelta(hours=9)  # 11 h before the reservation
            await service.poller.poll()
            [teardown] = await service.enforcer.tick()
            assert teardown.host == host.address and teardown.conflict_at == reserved_at
            operation = service.enforcer.running[host.address]
            assert (await harness.wait(operation)).state is OperationState.SUCCEEDED, operation.error
            assert await service.enforcer.tick() == []  # the node is gone; the success forgets the host
            assert service.enforcer.running == {} and service.enforcer.backoffs == {}
        finally:
            await service.aclose()

    assert harness.table.get(host.address) is None
    assert not alive(engine_pid) and host.engine_pid("vllm") is None
    task = next(t for t in await harness.provisioner.tasks() if t.hostname == host.address)
    assert (task.kind, task.state, task.current_step) == ("teardown", TaskState.SUCCEEDED, "teardown_complete")
    messages = [e.msg for e in harness.provisioner.logs.entries(host.address)]
    reason = next(m for m in messages if m.startswith("QUADS reserves"))
    assert f"QUADS reserves {host.address} from 2026-03-08 08:00 UTC for cloud02 (owner dana" in reason
    assert messages.index(reason) < messages.index("step stopping_engine")  # the reason comes first
    assert any(m.startswith("drained (0 request(s) still in flight)") for m in messages)  # drained before the stop
    # QUADS re-images the host before lending it again: its key left the known hosts with the node.
    assert f"[{host.address}]:{ssh_hosts.port} " not in ssh_hosts.known_hosts.read_text()
    ssh_hosts.write_known_hosts()


async def test_a_node_on_a_host_quads_marks_broken_is_torn_down_though_quads_lists_no_gpu(
    harness: Harness, ssh_hosts: SshHosts
) -> None:
    from qiip_core import HostReserved

    host = ssh_hosts[7]
    setup = await harness.provisioner.start_setup(
        SetupRequest(hostname=host.address, engine=Engine.VLLM, model="org/model", alias="served-model")
    )
    assert (await harness.wait(setup)).state is OperationState.SUCCEEDED, setup.error
    now = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    with QuadsServer(timezone="UTC", now=now) as quads:
        quads.add_host(host.address, gpus=0)  # QUADS knows the host but lists no GPU processor on it
        service = QuadsService(
            QuadsSettings(url=quads.url, timezone="UTC"), harness.provisioner, harness.table, clock=lambda: now
        )
        try:
            await service.poller.poll()
            assert await service.enforcer.tick() == []  # free: nothing to do
            assert service.host_view(host.address) is not None and service.unprovisioned([]) == []
            quads.hosts[host.address].broken = True
            await service.poller.poll()
            [teardown] = await service.enforcer.tick()
            assert teardown.reason == f"QUADS marks {host.address} broken: tearing the node down, as for a reservation"
            operation = service.enforcer.running[host.address]
            assert (await harness.wait(operation)).state is OperationState.SUCCEEDED, operation.error
            # And it is not set up again while broken.
            with pytest.raises(HostReserved, match=f"Host {host.address} is marked broken in QUADS"):
                await service.check_setup(host.address)
        finally:
            await service.aclose()
            ssh_hosts.write_known_hosts()
    assert harness.table.get(host.address) is None

"""Host leases and task records in a real etcd: one operation per host across gateways, stale tasks recovered."""

from __future__ import annotations

import pytest

from qiip_core import HostBusy
from qiip_core.config import load_settings
from qiip_core.provisioning import EtcdTaskStore, ProvisioningTask, TaskState
from tests.support.etcd import EtcdServer

pytestmark = pytest.mark.integration


def store(etcd: EtcdServer, tmp_path, owner: str) -> EtcdTaskStore:
    settings = load_settings(
        state_dir=tmp_path,
        registry={"backend": "etcd"},
        etcd={"endpoints": [etcd.url]},
        provisioning={"host_lease_ttl_s": 5},
    )
    return EtcdTaskStore(settings, owner)


async def test_one_operation_per_host_across_gateways(etcd: EtcdServer, tmp_path) -> None:
    a, b = store(etcd, tmp_path, "gw-a:8080"), store(etcd, tmp_path, "gw-b:8080")
    lease = await a.acquire("gpu01", "op_a")
    with pytest.raises(HostBusy, match="operation op_a of gateway gw-a:8080 holds its lease"):
        await b.acquire("gpu01", "op_b")
    other = await b.acquire("gpu02", "op_b")  # another host is free
    await lease.release()
    await lease.release()  # exactly once: a second release does nothing
    again = await b.acquire("gpu01", "op_b2")
    await again.release()
    await other.release()


async def test_stale_tasks_are_marked_failed_at_the_step_where_they_stopped(etcd: EtcdServer, tmp_path) -> None:
    crashed, peer = store(etcd, tmp_path, "gw-a:8080"), store(etcd, tmp_path, "gw-b:8080")
    held = await crashed.acquire("gpu01", "op_1")
    await crashed.put(ProvisioningTask(hostname="gpu01", current_step="nvidia_driver", owner="gw-a:8080"))
    live = await peer.acquire("gpu02", "op_2")
    await peer.put(ProvisioningTask(hostname="gpu02", current_step="preflight", owner="gw-b:8080"))
    await crashed.put(ProvisioningTask(hostname="gpu03", current_step="uploading", owner="gw-c:8080"))  # lease expired

    restarted = store(etcd, tmp_path, "gw-a:8080")  # the crashed gateway, back on the same host and port
    marked = {t.hostname: t for t in await restarted.recover()}
    assert set(marked) == {"gpu01", "gpu03"}  # gpu02's gateway still holds its lease
    assert (marked["gpu01"].state, marked["gpu01"].failed_step) == (TaskState.FAILED, "nvidia_driver")
    assert "this gateway restarted" in (marked["gpu01"].error or "")
    assert "its host lease expired" in (marked["gpu03"].error or "")
    tasks = {t.hostname: t for t in await peer.list_tasks()}
    assert tasks["gpu02"].state is TaskState.RUNNING and tasks["gpu01"].state is TaskState.FAILED
    # The restarted gateway revoked its old lease: the host is free.
    lease = await peer.acquire("gpu01", "op_3")
    await lease.release()
    await live.release()
    await held.release()

"""Host leases and task records in a real etcd: one operation per host across gateways, fencing generations, and
the running tasks no live gateway holds."""

from __future__ import annotations

import asyncio

import pytest

from qiip_core import HostBusy, LeaseLost
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
    assert again.generation > lease.generation  # every lease of a host fences the ones before it
    await again.release()
    await other.release()


async def test_a_record_is_written_only_under_the_lease_of_its_generation(etcd: EtcdServer, tmp_path) -> None:
    a, b = store(etcd, tmp_path, "gw-a:8080"), store(etcd, tmp_path, "gw-b:8080")
    old = await a.acquire("gpu01", "op_old")
    await a.put(ProvisioningTask(hostname="gpu01", current_step="preflight", generation=old.generation))
    await asyncio.to_thread(a.revoke, old.lease_id)  # type: ignore[attr-defined]  # as if it had expired
    new = await b.acquire("gpu01", "op_new")
    # The stalled owner comes back: its write is refused, the new owner's goes through.
    with pytest.raises(LeaseLost, match="generation"):
        await a.put(ProvisioningTask(hostname="gpu01", current_step="nvidia_driver", generation=old.generation))
    await b.put(ProvisioningTask(hostname="gpu01", current_step="uploading", generation=new.generation))
    assert (await b.get("gpu01")).current_step == "uploading"
    await new.release()
    await old.release()


async def test_stale_tasks_are_those_no_live_gateway_holds(etcd: EtcdServer, tmp_path) -> None:
    crashed, peer = store(etcd, tmp_path, "gw-a:8080"), store(etcd, tmp_path, "gw-b:8080")
    held = await crashed.acquire("gpu01", "op_1")
    await crashed.put(ProvisioningTask(hostname="gpu01", current_step="nvidia_driver", owner="gw-a:8080"))
    live = await peer.acquire("gpu02", "op_2")
    await peer.put(ProvisioningTask(hostname="gpu02", current_step="preflight", owner="gw-b:8080"))
    await crashed.put(ProvisioningTask(hostname="gpu03", current_step="uploading", owner="gw-c:8080"))  # lease expired
    await crashed.put(ProvisioningTask(hostname="gpu04", state=TaskState.FAILED, owner="gw-c:8080"))

    restarted = store(etcd, tmp_path, "gw-a:8080")  # the crashed gateway, back on the same host and port
    stale = {t.hostname: why for t, why in await restarted.stale()}
    assert stale == {"gpu01": "this gateway restarted", "gpu03": "its host lease expired"}
    assert {t.hostname for t, _ in await peer.stale()} == {"gpu03"}  # gpu01's lease is alive for anyone else
    # The restarted gateway takes its own lease from before the restart at once; its old lease is gone.
    lease = await restarted.acquire("gpu01", "op_3")
    assert lease.generation > held.generation
    with pytest.raises(HostBusy):
        await peer.acquire("gpu01", "op_4")
    await lease.release()
    await live.release()
    await held.release()

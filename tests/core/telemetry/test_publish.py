"""The agent's HTTP endpoint in process: the token, the reading, and 503 while there is none."""

from __future__ import annotations

import ctypes.util

import httpx
import pytest
from etcd3gw.lease import Lease

from qiip_core import ConfigError
from qiip_core.config import EtcdSettings
from qiip_core.storage import EtcdClient
from qiip_core.telemetry import EtcdPublisher, HttpPublisher, TelemetryAgent
from tests.core.telemetry.test_store import reading
from tests.support.etcd import EtcdServer

NO_NVIDIA_DRIVER = pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this host has an NVIDIA driver library"
)


async def test_the_endpoint_answers_503_without_a_reading_and_the_reading_with_one() -> None:
    publisher = HttpPublisher(host="127.0.0.1", port=0, token="tok")
    await publisher.start()
    try:
        url = f"http://127.0.0.1:{publisher.port}/v1/telemetry"
        async with httpx.AsyncClient(trust_env=False) as client:
            auth = {"Authorization": "Bearer tok"}
            assert (await client.get(url)).status_code == 401
            assert (await client.get(url, headers={"Authorization": "Basic tok"})).status_code == 401
            empty = await client.get(url, headers=auth)
            assert empty.status_code == 503
            assert empty.json()["error"]["message"] == "No GPU reading to publish: no reading yet"
            await publisher.publish(reading())
            answered = await client.get(url, headers=auth)
            assert answered.status_code == 200 and answered.json()["gpus"][0]["index"] == 0
            await publisher.withdraw("NVML cannot be used on this host: NVML Shared Library Not Found.")
            gone = await client.get(url, headers=auth)
            assert gone.status_code == 503 and "Shared Library Not Found" in gone.json()["error"]["message"]
    finally:
        await publisher.aclose()


@NO_NVIDIA_DRIVER
async def test_an_agent_without_nvml_publishes_nothing() -> None:
    publisher = HttpPublisher(host="127.0.0.1", port=0, token="tok")
    agent = TelemetryAgent(publisher, node_id="n", hostname="h", interval_s=1.0)
    assert await agent.tick() is None
    assert await agent.tick() is None
    assert agent.published == 0


def test_the_endpoint_needs_a_token() -> None:
    with pytest.raises(ConfigError, match="needs a bearer token"):
        HttpPublisher(host="127.0.0.1", port=0, token="")


@pytest.mark.integration
async def test_a_lost_lease_is_replaced_and_a_clean_stop_revokes_it(etcd: EtcdServer) -> None:
    client = EtcdClient(EtcdSettings(endpoints=[etcd.url]))
    publisher = EtcdPublisher(client, b"/telemetry/gpu01", lease_ttl_s=30)
    await publisher.publish(reading())
    first = publisher.lease_id
    [kv] = etcd.range_prefix(b"/telemetry/")
    assert int(kv["lease"]) == first
    # The lease is lost (etcd was down longer than its TTL, say): the key goes with it, and the next reading
    # comes back under a new lease.
    client.call(lambda c: Lease(first, c).revoke())
    assert etcd.range_prefix(b"/telemetry/") == []
    await publisher.publish(reading())
    [kv] = etcd.range_prefix(b"/telemetry/")
    assert int(kv["lease"]) == publisher.lease_id != first
    await publisher.aclose()  # revokes the lease, and closes the client's connections
    assert etcd.range_prefix(b"/telemetry/") == []
    assert publisher.lease_id == 0

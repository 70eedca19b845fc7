"""The controller's leader lease in a real etcd: one gateway leads, a resigned one hands over at once and never takes
the lease back (a campaign still running in its thread when the gateway shuts down must not re-take it)."""

from __future__ import annotations

from pathlib import Path

from qiip_core.config import load_settings
from qiip_core.deployments import EtcdLeadership
from tests.support.etcd import EtcdServer


async def test_a_resigned_gateway_hands_the_lease_over_at_once_and_never_takes_it_back(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    settings = load_settings(
        state_dir=tmp_path,
        registry={"backend": "etcd"},
        etcd={"endpoints": [etcd.url]},
        deployments={"leader_ttl_s": 60},
    )
    first, second = EtcdLeadership(settings, "gw-a:8080"), EtcdLeadership(settings, "gw-b:8080")
    try:
        assert await first.campaign() and first.token > 0
        assert not await second.campaign() and second.leader == "gw-a:8080"
        await first.resign()
        assert not await first.campaign() and first.token == 0
        assert etcd.range_prefix(b"/deployments/leader") == []  # given up, not left to lapse
        assert await second.campaign() and second.token > 0
    finally:
        await second.resign()

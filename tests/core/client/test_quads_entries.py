"""The client (the console's and the CLI's) with a daemon that lists QUADS hosts: the bare hosts are left out, a
node keeps its `quads` view."""

from __future__ import annotations

import httpx

from qiip_core.client import QiipClient

NODE = {
    "id": "gpu01.lab",
    "endpoint": "http://gpu01.lab:8000",
    "status": "healthy",
    "model": "m",
    "engine": "vllm",
    "artifact_id": None,
    "managed": True,
    "source": "etcd",
    "quads": {
        "host": "gpu01.lab",
        "gpus": {"vendor": "NVIDIA", "product": "H100", "count": 8},
        "available": False,
        "next_reservation": {"start": "2026-12-01T14:00:00+00:00", "end": "2026-12-02T14:00:00+00:00", "owner": "a"},
        "next_conflict_at": "2026-12-01T14:00:00+00:00",
        "conflict_within_lookahead": True,
        "data_age_s": 12.5,
        "stale": False,
        "a_later_key": 1,
    },
}
BARE: dict[str, object] = {"id": "gpu07.lab", "endpoint": None, "status": "not_provisioned", "model": None}
BARE |= {"engine": None, "source": "quads", "quads": {"host": "gpu07.lab"}}


async def test_nodes_leaves_out_hosts_known_only_to_quads_and_reads_a_nodes_quads_view() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"nodes": [NODE, BARE], "quads": {"age_s": 12.5, "stale": False}})

    async with QiipClient("http://daemon", username="u", password="p", transport=httpx.MockTransport(answer)) as c:
        [node] = await c.nodes()
    assert node.id == "gpu01.lab" and node.quads is not None
    assert node.quads.conflict_within_lookahead and node.quads.gpus["count"] == 8
    assert node.quads.next_reservation is not None and node.quads.next_reservation.start.hour == 14

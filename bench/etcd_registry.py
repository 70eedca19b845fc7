"""etcd registry benchmark: snapshot load time at 5,000 nodes, and put → routable delay.

Starts a real etcd on loopback, registers `--nodes` nodes, then measures in one run:

- the snapshot: from `EtcdRegistry.start()` to every node being in a routing table;
- the delay from the start of a put to the changed node being routable in the table (p50/p99 over
  `--changes` changes), next to the same delay seen by a bare watch on the v3 JSON gateway (the baseline:
  what etcd itself takes to deliver the event).

    uv run python bench/etcd_registry.py [--nodes 5000] [--changes 200]

Needs `etcd` (Debian package `etcd-server`). Targets: snapshot ≤ 2 s; change → routable ≤ 100 ms p99.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import etcd3gw

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qiip_core.config import load_settings
from qiip_core.discovery import EtcdRegistry, RegistryEvent, RegistryEventKind
from qiip_core.routing import RoutingTable
from tests.support.etcd import EtcdServer


def node_value(i: int, model: str = "bench") -> str:
    return json.dumps({"endpoint": f"http://127.0.0.1:{10000 + i % 50000}", "model": model, "status": "healthy"})


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


async def bare_watch_delays(url: str, client: Any, changes: int) -> list[float]:
    seen: dict[str, float] = {}
    delays = []
    async with aiohttp.ClientSession() as session:
        body = {"create_request": {"key": b64("/bare/"), "range_end": b64("/bare0")}}
        async with session.post(url + "/v3/watch", json=body, timeout=aiohttp.ClientTimeout(total=None)) as resp:
            lines = resp.content.__aiter__()
            await lines.__anext__()  # the "created" message
            for i in range(changes):
                key = f"/bare/{i}"
                put_started = time.perf_counter()
                await asyncio.to_thread(client.put, key, "x")
                while key not in seen:
                    message = json.loads(await lines.__anext__())
                    for event in message.get("result", {}).get("events", []):
                        seen[base64.b64decode(event["kv"]["key"]).decode()] = time.perf_counter()
                delays.append(seen[key] - put_started)
    return delays


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("etcd is not installed (Debian package etcd-server).")
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(Path(tmp) / "data") as etcd:
        client: Any = etcd3gw.client(host="127.0.0.1", port=etcd.client_port, timeout=30)
        started = time.perf_counter()
        for start in range(0, args.nodes, 100):
            ops = [
                {"request_put": {"key": b64(f"/nodes/n{i:05d}"), "value": b64(node_value(i))}}
                for i in range(start, min(start + 100, args.nodes))
            ]
            client.transaction({"compare": [], "success": ops, "failure": []})
        print(f"registered {args.nodes} nodes in {time.perf_counter() - started:.2f} s")

        settings = load_settings(state_dir=tmp, registry={"backend": "etcd"}, etcd={"endpoints": [etcd.url]})
        table = RoutingTable()
        applied: dict[str, float] = {}
        arrived = asyncio.Event()

        def on_event(event: RegistryEvent) -> None:
            if event.kind is RegistryEventKind.PUT and event.node is not None:
                table.apply_put(event.node, source=event.source)
                applied[event.node_id] = time.perf_counter()
                arrived.set()
            else:
                table.apply_delete(event.node_id)

        registry = EtcdRegistry(settings)
        started = time.perf_counter()
        await registry.start(on_event)
        snapshot_s = time.perf_counter() - started
        assert len(table) == args.nodes, len(table)

        delays = []
        for i in range(args.changes):
            node_id = f"change{i}"
            put_started = time.perf_counter()
            await asyncio.to_thread(client.put, f"/nodes/{node_id}", node_value(i, model=f"changed-{i}"))
            while node_id not in applied:
                arrived.clear()
                await arrived.wait()
            table.reserve(f"changed-{i}").release()
            delays.append(applied[node_id] - put_started)
        await registry.aclose()
        baseline = await bare_watch_delays(etcd.url, client, args.changes)

    ms = [d * 1000 for d in delays]
    base_ms = [d * 1000 for d in baseline]
    print(f"snapshot of {args.nodes} nodes into the routing table: {snapshot_s:.3f} s (target <= 2 s)")
    print(
        f"put -> routable over {args.changes} changes: p50 {statistics.median(ms):.2f} ms, "
        f"p99 {percentile(ms, 99):.2f} ms (target p99 <= 100 ms)"
    )
    ratio = statistics.median(ms) / max(statistics.median(base_ms), 1e-6)
    print(
        f"baseline, a bare watch on the same etcd: p50 {statistics.median(base_ms):.2f} ms, "
        f"p99 {percentile(base_ms, 99):.2f} ms; QIIP / baseline at p50: {ratio:.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())

"""Live GPU telemetry benchmark: what 1,000 hosts reporting at 1 Hz cost the daemon, in CPU per update.

Each host's reading has `--gpus` GPUs with two processes each (about 2.9 KB of JSON at 8 GPUs). Measured in one run:

- **baseline**: `json.loads` of the reading's JSON alone, the least any ingestion must do;
- **ingest**: the daemon's whole path for one etcd watch event, from the key/value etcd's JSON gateway gives
  (base64 value) to the store: base64, JSON, validation as a `NodeTelemetry`, `TelemetryStore.put`;
- **etcd, end to end** (unless `--no-etcd`): a real etcd on loopback, a writer process putting every host's
  reading once a second (transactions of 100 keys), and this process following the prefix with the daemon's
  `EtcdTelemetryWatch`; the figure is this process's CPU time (all threads) over the updates it received;
- **scrape**: one Prometheus scrape of every host's GPUs (`GpuCollector`, text exposition).

    uv run python bench/telemetry.py [--hosts 1000] [--gpus 8] [--seconds 10] [--no-etcd]

CPU figures are `time.process_time()` (user + system, every thread), best of `--repeat` runs for the in-process
parts. A core's share at 1,000 updates/s is µs per update / 1,000.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, generate_latest

from qiip_core.config import load_settings
from qiip_core.telemetry import EtcdTelemetryWatch, NodeTelemetry, TelemetryStore, encode_reading
from qiip_proxy._gpu_metrics import GpuCollector
from tests.support.etcd import EtcdServer

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def reading(host: int, second: int, gpus: int) -> NodeTelemetry:
    """Host `host`'s reading at second `second`: `gpus` busy GPUs, two processes each."""
    return NodeTelemetry.model_validate(
        {
            "node_id": f"gpu{host:04d}",
            "hostname": f"gpu{host:04d}.example",
            "read_at": T0 + timedelta(seconds=second),
            "interval_s": 1.0,
            "driver_version": "580.126.09",
            "gpus": [
                {
                    "index": i,
                    "name": "NVIDIA H100 80GB HBM3",
                    "uuid": f"GPU-{host:08x}-0000-4000-8000-{i:012x}",
                    "memory_used_mib": 60000 + second % 1000,
                    "memory_total_mib": 81559,
                    "utilization_percent": (host + second + i) % 101,
                    "temperature_c": 60 + i,
                    "power_w": 512.25,
                    "processes": [
                        {"pid": 1000 + i, "name": "llama-server", "used_memory_mib": 59000},
                        {"pid": 2000 + i, "name": "python3", "used_memory_mib": 1000},
                    ],
                    "process_count": 2,
                }
                for i in range(gpus)
            ],
        }
    )


def best_cpu_us(work: Any, count: int, repeat: int) -> float:
    """CPU µs per item of `work()` (which handles `count` items), best of `repeat` runs."""
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        work()
        best = min(best, time.process_time() - started)
    return best / count * 1e6


_WRITER = """
import base64, json, sys, time
import etcd3gw
port, hosts, seconds, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
values = json.load(open(path))
client = etcd3gw.client(host="127.0.0.1", port=port, timeout=30)
b64 = lambda data: base64.b64encode(data.encode()).decode()
start = time.monotonic()
for second in range(seconds):
    for first in range(0, hosts, 100):
        ops = [{"request_put": {"key": b64(f"/telemetry/gpu{h:04d}"), "value": b64(values[second % 2][h])}}
               for h in range(first, min(first + 100, hosts))]
        client.transaction({"compare": [], "success": ops, "failure": []})
    time.sleep(max(0.0, start + second + 1 - time.monotonic()))
"""


class _CountingStore(TelemetryStore):
    """The daemon's store, counting the updates it receives."""

    def __init__(self, expected: int) -> None:
        super().__init__(expire_after_intervals=3)
        self.expected = expected
        self.received = 0
        self.all_received = asyncio.Event()

    def put(self, reading: NodeTelemetry) -> bool:
        self.received += 1
        if self.received >= self.expected:
            self.all_received.set()
        return super().put(reading)


async def etcd_end_to_end(args: argparse.Namespace, tmp: Path) -> tuple[float, int, float]:
    """(CPU µs per update received, updates received, seconds) with a real etcd and a writer process."""
    values = [[encode_reading(reading(h, s, args.gpus)).decode() for h in range(args.hosts)] for s in range(2)]
    (tmp / "values.json").write_text(json.dumps(values))
    with EtcdServer(tmp / "etcd") as etcd:
        settings = load_settings(state_dir=tmp, registry={"backend": "etcd"}, etcd={"endpoints": [etcd.url]})
        expected = args.hosts * args.seconds
        store = _CountingStore(expected)
        watch = EtcdTelemetryWatch(settings, store)
        await watch.start()
        argv = [sys.executable, "-c", _WRITER, str(etcd.client_port), str(args.hosts), str(args.seconds)]
        started_cpu, started = time.process_time(), time.perf_counter()
        writer = await asyncio.create_subprocess_exec(*argv, str(tmp / "values.json"))
        await writer.wait()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(store.all_received.wait(), 30)
        received = store.received
        cpu_s, wall_s = time.process_time() - started_cpu, time.perf_counter() - started
        await watch.aclose()
    return cpu_s / max(received, 1) * 1e6, received, wall_s


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=10, help="seconds of 1 Hz updates through etcd")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-etcd", action="store_true", help="skip the end-to-end run through a real etcd")
    args = parser.parse_args()

    # Two seconds' worth of readings, so every update of a host is a new one (as at 1 Hz).
    values = [encode_reading(reading(h, s, args.gpus)) for s in range(2) for h in range(args.hosts)]
    kvs = [{"value": base64.b64encode(v).decode(), "lease": "1"} for v in values]
    names = [f"gpu{h:04d}" for h in range(args.hosts)] * 2
    count = len(values)
    print(f"{args.hosts} hosts x {args.gpus} GPUs: {len(values[0])} bytes of JSON per reading")

    baseline_us = best_cpu_us(lambda: [json.loads(v) for v in values], count, args.repeat)

    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(
            state_dir=tmp, registry={"backend": "etcd"}, etcd={"endpoints": ["http://127.0.0.1:9"]}
        )
        store = TelemetryStore(expire_after_intervals=3)
        watch = EtcdTelemetryWatch(settings, store)

        def ingest() -> None:
            for name, kv in zip(names, kvs, strict=True):
                watch._apply_put(name, kv, 1)
            for name in names[: args.hosts]:
                store.delete(name)  # the next run's readings are new again

        ingest_us = best_cpu_us(ingest, count, args.repeat)
        for name, kv in zip(names, kvs, strict=True):
            watch._apply_put(name, kv, 1)
        registry = CollectorRegistry()
        registry.register(GpuCollector(store))
        scrape = generate_latest(registry)
        scrape_ms = best_cpu_us(lambda: generate_latest(registry), 1, args.repeat) / 1000

        print(f"baseline, json.loads of a reading:  {baseline_us:8.1f} µs CPU per update")
        print(
            f"ingest, etcd watch event -> store:  {ingest_us:8.1f} µs CPU per update "
            f"({ingest_us / baseline_us:.1f} x baseline; {ingest_us * args.hosts / 1e4:.2f} % of a core at "
            f"{args.hosts} updates/s)"
        )
        if not args.no_etcd:
            if shutil.which("etcd") is None:
                sys.exit("etcd is not installed (Debian package etcd-server); run with --no-etcd.")
            e2e_us, received, wall_s = await etcd_end_to_end(args, Path(tmp))
            print(
                f"etcd end to end, watch -> store:   {e2e_us:8.1f} µs CPU per update "
                f"({e2e_us / baseline_us:.1f} x baseline; {received} updates in {wall_s:.1f} s)"
            )
        print(
            f"scrape of {args.hosts * args.gpus} GPUs (/metrics): {scrape_ms:8.1f} ms CPU per scrape "
            f"({len(scrape) / 1e6:.1f} MB of text)"
        )


if __name__ == "__main__":
    asyncio.run(main())

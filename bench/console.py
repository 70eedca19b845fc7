"""How fast the console's fleet screen follows a large, busy fleet.

A fleet of `--nodes` nodes (1,000) changes `--rate` times a second (10) for `--duration-s` seconds (20): each
change is a node event from a fake event source (status, in-flight and GPU memory move at random, seeded). The
fleet table is sorted by status (`--sort`), so a change usually moves its row. For each batch the benchmark measures, on
the console's own event loop:

- apply: the fleet table's `sync()` of the batch (cells updated, rows re-sorted);
- end to end: from the event entering the event source to the screen having been rendered after the update
  (the event travels the app's worker, its message handler and the fleet signal first);
- metrics poll: the fleet table's `sync()` after a poll of `/admin/metrics` every `--metrics-interval-s` (5 s,
  the console's default), which gives every node with traffic new rates (requests, errors, retries, slots,
  TTFT) and moves their rows; and the error cells' ages, re-rendered on each poll. Polls happen during the
  event batches, so their cost shows in the end-to-end figures too.

With `--telemetry`, every node also reports live GPUs (`gpus_live`, as `qiip agent` publishes them at 1 Hz): each
poll's node list carries a new reading for every node (memory, utilisation, temperature, power of each GPU), so
every row's GPU cell may change on every poll.

    uv run python bench/console.py                 # p50/p99 in ms; the target is p99 <= 50 ms end to end
    uv run python bench/console.py --batch 10 --rate 10
    uv run python bench/console.py --telemetry     # 1,000 nodes' live GPUs, new at every poll
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qiip_core.client import NodeInfo
from qiip_core.telemetry import GpuReading, LiveGpus
from qiip_tui import QiipConsole
from qiip_tui._fleet import FleetDelta
from qiip_tui.widgets import FleetTable
from tests.tui.fakes import FakeClient
from tests.tui.samples import node, runtime

STATUSES = ("healthy", "healthy", "healthy", "draining", "unhealthy", "unknown")


def make_fleet(n: int, rng: random.Random) -> list[NodeInfo]:
    fleet = []
    for i in range(n):
        gpus = tuple((rng.randint(1000, 80000), 81920) for _ in range(rng.choice((1, 2, 4, 8))))
        fleet.append(
            node(
                f"gpu{i:04d}",
                model=f"org/model-{i % 17}",
                status=rng.choice(STATUSES),
                in_flight=rng.randint(0, 8),
                llamacpp_runtime=runtime(gpus=gpus),
            )
        )
    return fleet


def changed(info: NodeInfo, rng: random.Random) -> NodeInfo:
    update: dict[str, Any] = {"status": rng.choice(STATUSES), "in_flight": rng.randint(0, 16)}
    if info.llamacpp_runtime is not None:
        gpus = [
            {**gpu, "used_mib": (used := rng.randint(1000, 80000)), "free_mib": gpu["total_mib"] - used}
            for gpu in info.llamacpp_runtime.gpus
        ]
        update["llamacpp_runtime"] = info.llamacpp_runtime.model_copy(update={"gpus": gpus})
    return info.model_copy(update=update)


def live_gpus(info: NodeInfo, rng: random.Random) -> LiveGpus:
    """A new live reading of the node's GPUs, as `qiip agent` publishes it."""
    runtime = info.llamacpp_runtime
    gpus = [
        GpuReading(
            index=i,
            name="NVIDIA H100 80GB HBM3",
            uuid=f"GPU-{info.id}-{i}",
            memory_used_mib=rng.randint(1000, 80000),
            memory_total_mib=81920,
            utilization_percent=rng.randint(0, 100),
            temperature_c=rng.randint(30, 80),
            power_w=rng.uniform(60, 700),
        )
        for i in range(len(runtime.gpus) if runtime is not None else 1)
    ]
    return LiveGpus(read_at=datetime.now(UTC), age_s=0.5, stale=False, interval_s=1.0, gpus=gpus)


class BusyFleetClient(FakeClient):
    """A fake daemon whose request counters grow at random between two polls, for every node; with `telemetry`,
    every node list it answers carries a new live GPU reading of each node."""

    def __init__(self, nodes: list[NodeInfo], rng: random.Random, *, telemetry: bool = False) -> None:
        super().__init__(nodes)
        self.rng = rng
        self.telemetry = telemetry
        self.totals: dict[str, dict[str, float]] = {}

    async def nodes(self) -> list[NodeInfo]:
        nodes = await super().nodes()
        if not self.telemetry:
            return nodes
        return [info.model_copy(update={"gpus_live": live_gpus(info, self.rng)}) for info in nodes]

    async def metrics(self) -> dict[str, Any]:
        by_node = {}
        for node_id in self.nodes_by_id:
            counts = self.totals.setdefault(
                node_id, {"requests": 0.0, "errors": 0.0, "retries": 0.0, "failures": 0.0, "attempts": 0.0}
            )
            answered, failed = self.rng.randint(0, 50), self.rng.choice((0, 0, 0, 1, 3))
            counts["requests"] += answered
            counts["failures"] += failed
            counts["retries"] += failed
            counts["attempts"] += answered + failed
            counts["completion_tokens"] = counts.get("completion_tokens", 0.0) + answered * 120
            by_node[node_id] = dict(counts, ttft_p50_s=self.rng.uniform(0.05, 2.0), ttft_p95_s=2.5)
        return {"by_model": {}, "by_node": by_node}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    fleet = make_fleet(args.nodes, rng)
    client = BusyFleetClient(fleet, rng, telemetry=args.telemetry)
    app = QiipConsole(
        client=client,
        metrics_interval_s=args.metrics_interval_s,
        theme_dirs=[Path(__file__).parent.parent / "themes"],
    )
    apply_ms: list[float] = []
    poll_ms: list[float] = []
    end_to_end_ms: list[float] = []
    rendered = asyncio.Event()
    batch_started = 0.0

    async with app.run_test(size=(args.width, args.height)) as pilot:
        while len(app.fleet.nodes) < args.nodes:
            await pilot.pause(0.05)
        table = app.screen.query_one(FleetTable)
        await pilot.pause()
        table.sort_by(args.sort, reverse=False)
        sync = table.sync

        def timed_sync(delta: FleetDelta | None = None) -> None:
            started = time.perf_counter()
            sync(delta)
            took_ms = (time.perf_counter() - started) * 1000
            # A poll changes many rows at once (or none, when only the ages move on).
            (poll_ms if delta is not None and (len(delta.changed) > args.batch or not delta) else apply_ms).append(
                took_ms
            )
            app.call_after_refresh(rendered.set)

        table.sync = timed_sync  # type: ignore[method-assign]
        apply_ms.clear()

        batches = int(args.duration_s * args.rate / args.batch)
        interval_s = args.batch / args.rate
        next_at = time.perf_counter()
        for _ in range(batches):
            next_at += interval_s
            rendered.clear()
            batch_started = time.perf_counter()
            for info in rng.sample(list(client.nodes_by_id.values()), args.batch):
                client.push("updated", changed(info, rng))
            await asyncio.wait_for(rendered.wait(), timeout=10)
            end_to_end_ms.append((time.perf_counter() - batch_started) * 1000)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        rows = table.row_count

    print(
        f"fleet screen: {args.nodes} nodes ({rows} rows), {args.rate:g} changes/s in batches of {args.batch}, "
        f"{len(end_to_end_ms)} batches over {args.duration_s:g} s, sorted by {args.sort}, {args.width}x{args.height}"
        + (", live GPUs of every node new at every poll" if args.telemetry else "")
    )
    measured = [("apply (table sync)", apply_ms), ("end to end (event to rendered)", end_to_end_ms)]
    if poll_ms:
        measured.append((f"metrics poll ({len(poll_ms)} polls)", poll_ms))
    for name, samples in measured:
        print(
            f"  {name:32} p50 {percentile(samples, 0.5):6.2f} ms   p99 {percentile(samples, 0.99):6.2f} ms   "
            f"max {max(samples):6.2f} ms   mean {statistics.fmean(samples):6.2f} ms"
        )
    p99 = percentile(end_to_end_ms, 0.99)
    verdict = "meets" if p99 <= args.target_ms else "MISSES"
    print(f"  end-to-end p99 {p99:.2f} ms {verdict} the {args.target_ms:g} ms target")
    return 0 if p99 <= args.target_ms else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0, help="node changes per second")
    parser.add_argument("--batch", type=int, default=1, help="changes sent together")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=48)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sort", default="status", help="the column the table is sorted by (id, status, …)")
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument("--metrics-interval-s", type=float, default=5.0, help="seconds between metrics polls")
    parser.add_argument("--telemetry", action="store_true", help="every node reports live GPUs, new at every poll")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:
        # The console remembers its theme under XDG_CONFIG_HOME; keep the benchmark's away from the user's.
        os.environ["XDG_CONFIG_HOME"] = home
        return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

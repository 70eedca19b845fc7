"""The data path's cost, per request and per stream event: the same load straight to the fast stand-in backend,
through nginx, through QIIP at a baseline revision and through QIIP now, in one run, with every figure's ratio to
the baseline and to nginx.

For each target, with the closed-loop load generator of `bench/overload.py` (raw asyncio on uvloop, in its own
process, on the backend's core; the proxy has the other core):

- non-streaming chat completions at concurrency 1: the p50 latency, and what the proxy adds to the direct p50;
- the same at concurrency 32 and 256: successful requests/s, p50/p99 of requests sent after a 1 s warm-up, and
  requests per proxy CPU-second (the target's CPU time over the measured window, from `/proc/PID/stat`);
- streaming chat completions of `--events` events and `[DONE]` at concurrency 32: the proxy's CPU per relayed
  event (CPU time over the window ÷ (streams × (events + 1))), request costs included.

    uv run python bench/datapath.py --baseline 181eaf9 [--duration 5] [--rounds 3]

Each load runs against every target in turn (direct, nginx, baseline, now) before the next load; with `--rounds N`
all of it N times, and the median of each figure is shown: the machine's other work then weighs on every target
alike. The baseline runs that
revision's code (a `git archive` of it) in this checkout's environment. nginx (Debian package `nginx-light`) has
one worker, a keep-alive upstream and no buffering (`bench/gateway.py`). The gateways run with their default
settings, one serving process (`server.workers = 1`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import overload  # noqa: E402
from bench.gateway import free_port, pinned, start_gateway, start_nginx, wait_http  # noqa: E402


@dataclass
class Figures:
    """One target's measurements, a list per figure (one value per round)."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def get(self, name: str) -> float | None:
        found = self.values.get(name)
        return statistics.median(found) if found else None


LOADS = ("c1", "c32", "c256", "stream")
"""The loads, in the order each round runs them (every target in turn under one load, then the next load)."""


def measure(load: str, port: int, pid: int, figures: Figures, *, duration_s: float, events: int, proxy: bool) -> str:
    """One load against one target, into `figures`; returns a line saying what it measured."""
    overload.DURATION[0] = duration_s
    if load == "c1":
        one = overload.run_load(port, pid, connections=1, duration_s=duration_s, backoff_s=0)
        figures.add("p50_c1_ms", one.ok_p50_ms)
        return f"p50 {one.ok_p50_ms:.3f} ms"
    if load == "stream":
        streams = overload.run_load(port, pid, connections=32, duration_s=duration_s, backoff_s=0, stream=True)
        figures.add("streams_s", streams.ok_rps)
        if not (proxy and streams.ok_rps):
            return f"{streams.ok_rps:,.0f} streams/s"
        per_event_us = streams.cpu_s / (streams.ok_rps * duration_s * (events + 1)) * 1e6
        figures.add("us_per_event", per_event_us)
        return f"{streams.ok_rps:,.0f} streams/s, {per_event_us:.2f} µs of proxy CPU per event"
    c = int(load[1:])
    run = overload.run_load(port, pid, connections=c, duration_s=duration_s, backoff_s=0)
    figures.add(f"rps_c{c}", run.ok_rps)
    figures.add(f"p50_c{c}_ms", run.ok_p50_ms)
    figures.add(f"p99_c{c}_ms", run.ok_p99_ms)
    if proxy:
        figures.add(f"per_cpu_s_c{c}", run.ok_per_cpu_s)
    per_cpu = f", {run.ok_per_cpu_s:,.0f} per proxy CPU-s" if proxy else ""
    return f"{run.ok_rps:,.0f} req/s{per_cpu}, p99 {run.ok_p99_ms:.1f} ms"


ROWS = (
    ("requests per proxy CPU-s, c=32", "per_cpu_s_c32", "{:,.0f}", True),
    ("requests per proxy CPU-s, c=256", "per_cpu_s_c256", "{:,.0f}", True),
    ("c=256 rate / c=32 rate", "keep_256", "{:.0%}", True),
    ("requests/s, c=32", "rps_c32", "{:,.0f}", True),
    ("p50 c=32 (ms)", "p50_c32_ms", "{:.2f}", False),
    ("p99 c=32 (ms)", "p99_c32_ms", "{:.1f}", False),
    ("p50 c=256 (ms)", "p50_c256_ms", "{:.2f}", False),
    ("p99 c=256 (ms)", "p99_c256_ms", "{:.1f}", False),
    ("p50 c=1 (ms)", "p50_c1_ms", "{:.3f}", False),
    ("added p50 c=1 vs direct (ms)", "added_c1_ms", "{:.3f}", False),
    ("proxy CPU per SSE event (µs)", "us_per_event", "{:.2f}", False),
    ("streams/s, c=32", "streams_s", "{:,.0f}", True),
)
"""The summary's rows: label, figure, format, and whether more is better (ratios are shown as they are)."""


def summary(results: dict[str, Figures], names: list[str], baseline: str | None) -> None:
    """Print the table of figures per target, with the current code's ratios to the baseline and to nginx."""
    direct = results["direct"].get("p50_c1_ms")
    for figures in results.values():
        c1 = figures.get("p50_c1_ms")
        if direct is not None and c1 is not None:
            figures.values["added_c1_ms"] = [c1 - direct]
        c32, c256 = figures.get("per_cpu_s_c32"), figures.get("per_cpu_s_c256")
        if c32 and c256:
            figures.values["keep_256"] = [c256 / c32]
    columns = [*names, *([f"now/{baseline}"] if baseline else []), "now/nginx" if "nginx" in results else ""]
    columns = [c for c in columns if c]
    print()
    print(f"{'figure':<34} " + " ".join(f"{c:>13}" for c in columns))
    print("-" * (35 + 14 * len(columns)))
    now = results["now"]
    for label, key, form, _ in ROWS:
        cells = []
        for name in names:
            value = results[name].get(key)
            cells.append(form.format(value) if value is not None else "")
        for other in ([baseline] if baseline else []) + (["nginx"] if "nginx" in results else []):
            mine, theirs = now.get(key), results[other].get(key)
            cells.append(f"{mine / theirs:.2f}x" if mine is not None and theirs else "")
        print(f"{label:<34} " + " ".join(f"{cell:>13}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per load (after 1 s warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="times every target is measured, by turns")
    parser.add_argument("--events", type=int, default=100, help="events per streamed answer")
    parser.add_argument("--baseline", metavar="REV", help="also run QIIP at this revision, e.g. 181eaf9")
    parser.add_argument("--targets", default="direct,nginx,baseline,now", help="which of them to run")
    args = parser.parse_args()

    backend_port = free_port()
    backend_argv = [sys.executable, str(ROOT / "bench" / "backend.py"), "--port", str(backend_port)]
    backend = subprocess.Popen(pinned([*backend_argv, "--events", str(args.events)], 0))
    state = tempfile.mkdtemp(prefix="qiip-datapath-")
    procs: list[subprocess.Popen[bytes]] = [backend]
    chosen = args.targets.split(",")
    try:
        wait_http(f"http://127.0.0.1:{backend_port}/health")
        targets: list[tuple[str, int, int]] = []
        if "direct" in chosen:
            targets.append(("direct", backend_port, backend.pid))
        if "nginx" in chosen:
            nginx, nginx_port = start_nginx(backend_port, state)
            if nginx is not None:
                procs.append(nginx)
                wait_http(f"http://127.0.0.1:{nginx_port}/health")
                targets.append(("nginx", nginx_port, nginx.pid))
        if args.baseline and "baseline" in chosen:
            source = Path(state) / "baseline-src"
            source.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
            base, base_port = start_gateway(backend_port, state + "/base", {}, source=str(source))
            procs.append(base)
            targets.append((args.baseline, base_port, base.pid))
        if "now" in chosen:
            qiip, qiip_port = start_gateway(backend_port, state + "/now", {})
            procs.append(qiip)
            targets.append(("now", qiip_port, qiip.pid))
        print(
            f"{args.duration:g} s per load, {args.rounds} round(s), {args.events}-event streams, "
            f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        results = {name: Figures() for name, _, _ in targets}
        for round_ in range(args.rounds):
            # Every target under one load, then the next load: what is compared is measured minutes apart at most.
            for load in LOADS:
                for name, port, pid in targets:
                    line = measure(
                        load,
                        port,
                        pid,
                        results[name],
                        duration_s=args.duration,
                        events=args.events,
                        proxy=name != "direct",
                    )
                    print(f"round {round_ + 1} {load:>6} {name:>8}: {line}", flush=True)
        summary(results, [name for name, _, _ in targets], args.baseline if args.baseline in results else None)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

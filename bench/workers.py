"""Every core (`server.workers`): per-core efficiency of two serving processes against one, and the fairness of
least-connections over nodes when two processes route, in one run beside direct and nginx baselines.

Efficiency: `wrk` sends non-streaming chat completions at concurrency 32 and 256 straight to a fast stand-in
node, through nginx with one and with two worker processes, and through QIIP with `server.workers = 1` and
`= 2`; for every target the CPU time its processes used over the run is read from `/proc`, so each figure is
requests per proxy CPU-second, and the two-process figure is printed as a share of the one-process one
(target: at least 90%).

Fairness: four stand-in nodes serve the model; 64 streaming clients (each event 10 ms apart) go through QIIP with
two workers; each node's share of the requests, from the daemon's own `/metrics`, is printed against an even
share (target: no node above its share by more than 10%).

The nodes, the proxies and the load generator share this machine (2 cores here, nothing pinned: two workers need
both), so absolute numbers say little; the ratios measured in the same run are the result.

    uv run python bench/workers.py [--duration 10]

Needs `wrk` (Debian package `wrk`); nginx is used when installed (Debian package `nginx-light`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import NGINX_CONF, free_port, run_wrk, start_gateway, wait_http  # noqa: E402
from bench.overload import tree_cpu_s  # noqa: E402

CONCURRENCY = (32, 256)


def start_backend(port: int, *, events: int, delay_ms: float = 0.0) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(ROOT / "bench" / "backend.py"), "--port", str(port), "--events", str(events)]
    if delay_ms:
        argv += ["--delay-ms", str(delay_ms)]
    proc = subprocess.Popen(argv)
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def start_nginx(backend_port: int, workdir: Path, workers: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    conf = workdir / "nginx.conf"
    text = NGINX_CONF.format(prefix=workdir, backend=backend_port, port=port)
    conf.write_text(text.replace("worker_processes 1;", f"worker_processes {workers};"))
    proc = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"])
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc, port


@dataclass
class Measured:
    rps: float
    per_cpu_s: float
    p50_ms: float
    p99_ms: float


def measure(port: int, pid: int | None, duration_s: int, connections: int) -> Measured:
    """Requests/s and latency at `connections` and, for a proxy `pid`, its requests per CPU-second over the run."""
    before = tree_cpu_s(pid) if pid is not None else 0.0
    started = time.monotonic()
    result = run_wrk(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        connections=connections,
        duration_s=duration_s,
        stream=False,
        core=None,
    )
    elapsed = time.monotonic() - started
    cpu_s = tree_cpu_s(pid) - before if pid is not None else 0.0
    per_cpu_s = result.rps * elapsed / cpu_s if cpu_s else 0.0
    return Measured(result.rps, per_cpu_s, result.p50_ms, result.p99_ms)


def stop(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def efficiency(duration_s: int, state: Path) -> None:
    backend_port = free_port()
    backend = start_backend(backend_port, events=16)
    procs: list[subprocess.Popen[bytes] | None] = [backend]
    rows: dict[int, list[tuple[str, Measured]]] = {c: [] for c in CONCURRENCY}
    try:
        for c in CONCURRENCY:
            rows[c].append(("direct", measure(backend_port, None, duration_s, c)))
        if shutil.which("nginx"):
            for workers in (1, 2):
                nginx, port = start_nginx(backend_port, state / f"nginx-{workers}", workers)
                procs.append(nginx)
                for c in CONCURRENCY:
                    rows[c].append((f"nginx x{workers}", measure(port, nginx.pid, duration_s, c)))
                stop(nginx)
        for workers in (1, 2):
            gateway, port = start_gateway(
                backend_port, str(state / f"qiip-{workers}"), {"QIIP_SERVER__WORKERS": str(workers)}, core=None
            )
            procs.append(gateway)
            if workers > 1:
                wait_workers(gateway.pid, workers - 1)
            for c in CONCURRENCY:
                rows[c].append((f"qiip x{workers}", measure(port, gateway.pid, duration_s, c)))
            stop(gateway)
    finally:
        stop(*procs)
    print(f"non-streaming chat completions, {duration_s} s per run, cpus {os.cpu_count()}")
    print(
        f"{'c':>4} {'via':<9} | {'req/s':>8} {'vs direct':>9} | {'req/CPU-s':>9} {'vs x1':>6} | {'p50':>8} {'p99':>9}"
    )
    for c, measured in rows.items():
        direct = measured[0][1]
        per_one = {name.split()[0]: m.per_cpu_s for name, m in measured if name.endswith("x1")}
        for name, m in measured:
            one = per_one.get(name.split()[0])
            share = f"{m.per_cpu_s / one:>6.0%}" if m.per_cpu_s and one else f"{'':>6}"
            print(
                f"{c:>4} {name:<9} | {m.rps:>8.0f} {m.rps / direct.rps:>9.2f} | {m.per_cpu_s:>9.0f} {share} | "
                f"{m.p50_ms:>6.2f}ms {m.p99_ms:>7.2f}ms"
            )


def wait_workers(pid: int, count: int) -> None:
    """Wait until `pid` has `count` spawned worker processes serving."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spawned = [
            p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid and b"spawn_main" in _cmdline(int(p))
        ]
        if len(spawned) >= count:
            time.sleep(2.0)  # the worker's start-up: imports and the fleet
            return
        time.sleep(0.1)
    raise RuntimeError("the workers did not start")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def fairness(duration_s: int, state: Path) -> None:
    ports = [free_port() for _ in range(4)]
    backends = [start_backend(port, events=20, delay_ms=10) for port in ports]
    nodes = ",".join(
        f'{{"id": "n{i}", "endpoint": "http://127.0.0.1:{port}", "model": "bench"}}' for i, port in enumerate(ports)
    )
    gateway: subprocess.Popen[bytes] | None = None
    try:
        gateway, port = start_gateway(
            ports[0], str(state / "fair"), {"QIIP_SERVER__WORKERS": "2", "QIIP_NODES": f"[{nodes}]"}, core=None
        )
        wait_workers(gateway.pid, 1)
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{port}/health").json()["nodes_healthy"] < 4:
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes never became healthy")
            time.sleep(0.1)
        run_wrk(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            connections=64,
            duration_s=duration_s,
            stream=True,
            core=None,
        )
        time.sleep(0.5)  # the workers' last accounting
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        counts = {f"n{i}": 0.0 for i in range(4)}
        for node, value in re.findall(
            r'^qiip_requests_total\{model="bench",node="(n\d)",status="200"\} (\S+)$', text, re.M
        ):
            counts[node] += float(value)
        total = sum(counts.values())
        print()
        print(f"fairness: 4 nodes, 64 streaming clients (20 events 10 ms apart) through 2 workers, {duration_s} s")
        worst = 0.0
        for node, count in counts.items():
            over = count / (total / 4) - 1 if total else 0.0
            worst = max(worst, over)
            print(f"  {node}: {count:>6.0f} requests  {count / total:>6.1%} of them  {over:>+6.1%} vs an even share")
        print(f"  most above an even share: {worst:+.1%} (target: at most +10%)")
    finally:
        stop(gateway, *backends)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (Debian package `wrk`).")
    state = Path(tempfile.mkdtemp(prefix="qiip-bench-workers-"))
    try:
        efficiency(args.duration, state)
        fairness(args.duration, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Overload benchmark: the gateway past its capacity, with and without load shedding (`[admission]`), next to the
same load straight to the backend and through nginx, in one run.

A closed-loop load generator (raw asyncio on uvloop, in its own process: `c` keep-alive connections, each sending
its next non-streaming chat completion as soon as the last answer is in) runs against the fast stand-in backend
(`bench/backend.py`), nginx in front of it, QIIP without a bound, and QIIP with `admission.max_in_flight`. Unlike
`wrk`, it keeps successes and shed answers (429) apart: successful requests/s, shed requests/s, and the latency
of successes alone (requests sent after a 1 s warm-up). For every target the CPU time its processes used during
the run is read from `/proc/PID/stat`, so the efficiency figure is requests per proxy CPU-second.

By default a shed client retries at once (the worst case for the gateway: every connection always has a request
outstanding); `--backoff-ms 1000` makes it wait as `Retry-After: 1` asks, as the `openai` library does.

    uv run python bench/overload.py [--duration 5] [--concurrency 32,256] [--max-in-flight 32] [--backoff-ms 0]

The backend and the load generator share one core, the proxy has the other (`taskset`). nginx is used when
installed (Debian package `nginx-light`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import BODY, free_port, pinned, start_gateway, start_nginx, wait_http  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
WARMUP_S = 1.0


# -- the load generator (run in its own process: `overload.py --client ...`) --------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive client connection sending requests back to back and recording each answer."""

    def __init__(self, load: _Load) -> None:
        self.load = load
        self.buffer = b""
        self.sent_at = 0.0
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.send()

    def send(self) -> None:
        assert self.transport is not None
        if time.perf_counter() >= self.load.deadline:
            self.transport.close()
            return
        self.sent_at = time.perf_counter()
        self.transport.write(self.load.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buffer[:head_end].lower()
        start = head.find(b"content-length:")
        if start >= 0:
            line_end = head.find(b"\r\n", start)
            length = int(head[start + 15 : line_end if line_end >= 0 else len(head)])
            if len(self.buffer) < head_end + 4 + length:
                return
            rest = self.buffer[head_end + 4 + length :]
        else:  # chunked
            end = self.buffer.find(b"\r\n0\r\n\r\n", head_end)
            if end < 0:
                return
            rest = self.buffer[end + 7 :]
        status = int(self.buffer[9:12])
        self.buffer = rest
        now = time.perf_counter()
        self.load.record(status, now - self.sent_at, now)
        if status in (429, 503) and self.load.backoff_s > 0:
            asyncio.get_running_loop().call_later(self.load.backoff_s, self.send)
        else:
            self.send()

    def connection_lost(self, exc: Exception | None) -> None:
        if time.perf_counter() < self.load.deadline:
            # Closed by the target before the end (nginx's `keepalive_requests`, a crash): this connection is done.
            self.load.cut += 1
        if not self.lost.done():
            self.lost.set_result(None)


class _Load:
    def __init__(self, *, path: str, port: int, duration_s: float, backoff_s: float, stream: bool = False) -> None:
        body = json.dumps({**BODY, "stream": stream}).encode()
        self.request = (
            b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), len(body), body)
        )
        self.port = port
        self.started = time.perf_counter()
        self.measure_from = self.started + WARMUP_S
        self.deadline = self.measure_from + duration_s
        self.backoff_s = backoff_s
        self.latencies: dict[str, list[float]] = {"ok": [], "shed": [], "other": []}
        self.cut = 0

    def record(self, status: int, latency_s: float, now: float) -> None:
        # Requests sent during the warm-up are left out: the first request of each new connection waits for the
        # gateway to accept the connection and open one to the backend, behind every other connection's traffic.
        if now - latency_s < self.measure_from:
            return
        kind = "ok" if status == 200 else "shed" if status in (429, 503) else "other"
        self.latencies[kind].append(latency_s * 1000)


async def _run_client(
    port: int, connections: int, duration_s: float, backoff_s: float, stream: bool = False
) -> dict[str, object]:
    load = _Load(path="/v1/chat/completions", port=port, duration_s=duration_s, backoff_s=backoff_s, stream=stream)
    loop = asyncio.get_running_loop()
    protocols = []
    for _ in range(connections):
        _, protocol = await loop.create_connection(lambda: _Connection(load), "127.0.0.1", port)
        protocols.append(protocol)
    await asyncio.wait_for(asyncio.gather(*(p.lost for p in protocols)), duration_s + WARMUP_S + 30)
    result: dict[str, object] = {"duration_s": duration_s, "cut": load.cut}
    for kind, values in load.latencies.items():
        values.sort()
        result[kind] = {
            "n": len(values),
            "p50_ms": values[len(values) // 2] if values else 0.0,
            "p99_ms": values[int(len(values) * 0.99)] if values else 0.0,
        }
    return result


def client_main(argv: list[str]) -> None:
    import resource

    import uvloop

    port, connections, duration_s, backoff_s = int(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    stream = len(argv) > 4 and argv[4] == "stream"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps(uvloop.run(_run_client(port, connections, duration_s, backoff_s, stream))))


# -- the driver ----------------------------------------------------------------------------------------------------


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its child processes (nginx's worker)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, ..., utime (14th field of the line, 12th here), stime.
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


@dataclass
class Run:
    ok_rps: float
    shed_rps: float
    other: int
    cut: int
    ok_p50_ms: float
    ok_p99_ms: float
    shed_p99_ms: float
    cpu_s: float

    @property
    def per_cpu_s(self) -> float:
        """Answers (successful and shed) per CPU-second of the target."""
        return (self.ok_rps + self.shed_rps) * DURATION[0] / self.cpu_s if self.cpu_s else 0.0

    @property
    def ok_per_cpu_s(self) -> float:
        return self.ok_rps * DURATION[0] / self.cpu_s if self.cpu_s else 0.0


DURATION = [5.0]


def run_load(
    port: int, pid: int, *, connections: int, duration_s: float, backoff_s: float, stream: bool = False
) -> Run:
    """Drive `port` with `connections` closed-loop clients (streaming chat completions with `stream`) for
    `duration_s` seconds after the warm-up, reading the CPU time of `pid` and its children over that window."""
    argv = [sys.executable, __file__, "--client", str(port), str(connections), str(duration_s), str(backoff_s)]
    argv += ["stream"] if stream else []
    client = subprocess.Popen(pinned(argv, 0), stdout=subprocess.PIPE, text=True)
    # CPU time of the target over the measured window only (after the warm-up).
    time.sleep(WARMUP_S)
    before = tree_cpu_s(pid)
    time.sleep(duration_s)
    cpu_s = tree_cpu_s(pid) - before
    out, _ = client.communicate(timeout=duration_s + 60)
    result = json.loads(out)
    if result["cut"] or result["other"]["n"]:
        print(
            f"  warning: port {port}: {result['cut']} connection(s) closed early, {result['other']['n']} answer(s) "
            "neither 200 nor shed",
            file=sys.stderr,
        )
    ok, shed, other = result["ok"], result["shed"], result["other"]
    return Run(
        ok_rps=ok["n"] / duration_s,
        shed_rps=shed["n"] / duration_s,
        other=other["n"],
        cut=result["cut"],
        ok_p50_ms=ok["p50_ms"],
        ok_p99_ms=ok["p99_ms"],
        shed_p99_ms=shed["p99_ms"],
        cpu_s=cpu_s,
    )


def profiled_command(profile: str | None) -> list[str] | None:
    """The daemon's command line under cProfile (writing to `profile`), or None for the plain daemon."""
    return [sys.executable, __file__, "--profiled-gateway", profile] if profile else None


def profiled_gateway(path: str, argv: list[str]) -> None:
    """Run the daemon under cProfile and write the profile to `path` when it stops (on SIGTERM)."""
    import cProfile
    import signal

    from qiip_proxy._cli import main

    # uvicorn re-raises the SIGTERM it caught once it has shut down; with the default handler that would end the
    # process before the profile is written.
    signal.signal(signal.SIGTERM, lambda *_: None)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        main(argv, standalone_mode=False)
    finally:
        profiler.disable()
        profiler.dump_stats(path)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--profiled-gateway":
        profiled_gateway(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run (after 1 s warm-up)")
    parser.add_argument("--concurrency", default="32,256")
    parser.add_argument("--max-in-flight", type=int, default=32, help="admission.max_in_flight of the bounded QIIP")
    parser.add_argument("--backoff-ms", type=float, default=0.0, help="a shed client's wait before its next request")
    parser.add_argument("--targets", default="direct,nginx,qiip,bounded", help="which of them to run")
    parser.add_argument("--baseline", metavar="REV", help="also run QIIP (unbounded) at this revision, e.g. main")
    parser.add_argument("--profile", metavar="DIR", help="run both QIIP daemons under cProfile, dumps in DIR")
    args = parser.parse_args()
    DURATION[0] = args.duration

    backend_port = free_port()
    backend = subprocess.Popen(
        pinned([sys.executable, str(ROOT / "bench" / "backend.py"), "--port", str(backend_port)], 0)
    )
    state = tempfile.mkdtemp(prefix="qiip-overload-")
    procs: list[subprocess.Popen[bytes]] = [backend]
    try:
        wait_http(f"http://127.0.0.1:{backend_port}/health")
        prof_dir = Path(args.profile).resolve() if args.profile else None
        profile = str(prof_dir / "qiip.prof") if prof_dir else None
        qiip, qiip_port = start_gateway(backend_port, state + "/a", {}, command=profiled_command(profile))
        procs.append(qiip)
        bounded, bounded_port = start_gateway(
            backend_port,
            state + "/b",
            {"QIIP_ADMISSION__MAX_IN_FLIGHT": str(args.max_in_flight)},
            command=profiled_command(str(prof_dir / "bounded.prof") if prof_dir else None),
        )
        procs.append(bounded)
        baseline: tuple[subprocess.Popen[bytes], int] | None = None
        if args.baseline:
            source = Path(state) / "baseline-src"
            source.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
            baseline = start_gateway(backend_port, state + "/base", {}, source=str(source))
            procs.append(baseline[0])
        nginx, nginx_port = start_nginx(backend_port, state)
        if nginx is not None:
            procs.append(nginx)
            wait_http(f"http://127.0.0.1:{nginx_port}/health")
        chosen = args.targets.split(",")
        targets = [("direct", backend_port, backend.pid)] if "direct" in chosen else []
        targets += [("nginx", nginx_port, nginx.pid)] if nginx is not None and "nginx" in chosen else []
        targets += [(args.baseline[:8], baseline[1], baseline[0].pid)] if baseline is not None else []
        targets += [("qiip", qiip_port, qiip.pid)] if "qiip" in chosen else []
        targets += [(f"qiip≤{args.max_in_flight}", bounded_port, bounded.pid)] if "bounded" in chosen else []
        print(f"{args.duration:g} s per run, shed clients retry after {args.backoff_ms:g} ms, cpus {os.cpu_count()}")
        header = (
            f"{'c':>4} {'via':<8} | {'ok rps':>7} {'shed rps':>8} | {'ok p50':>8} {'ok p99':>8} {'shed p99':>8} | "
            f"{'cpu s':>5} {'answers/cpu-s':>13} {'ok/cpu-s':>8}"
        )
        print(header)
        print("-" * len(header))
        for c in (int(x) for x in args.concurrency.split(",")):
            for via, port, pid in targets:
                run = run_load(port, pid, connections=c, duration_s=args.duration, backoff_s=args.backoff_ms / 1000)
                print(
                    f"{c:>4} {via:<8} | {run.ok_rps:>7.0f} {run.shed_rps:>8.0f} | {run.ok_p50_ms:>6.2f}ms "
                    f"{run.ok_p99_ms:>6.1f}ms {run.shed_p99_ms:>6.1f}ms | {run.cpu_s:>5.2f} "
                    f"{run.per_cpu_s:>13.0f} {run.ok_per_cpu_s:>8.0f}"
                    + (f"  ({run.other} other)" if run.other else ""),
                    flush=True,
                )
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Many open streams: thousands of concurrent slow SSE streams (one event per second each) held through QIIP,
next to the same streams straight to the backend and through nginx, in one run; then a thousand clients
disconnecting at once.

A stand-in backend (raw asyncio on uvloop, in this file: `--backend`) answers each streaming request with one
`chat.completion.chunk` event every `--interval` seconds until the client goes, and records when each request's
connection closed, by its `X-Request-Id` (the gateway forwards it). A client process (`--client`, raw asyncio)
opens `--streams` connections, each one stream, and once every stream has had its first event measures for
`--window` seconds: the gap between consecutive events of a stream as the client sees it, and the events
received. Meanwhile the driver reads the target's CPU time (`/proc/PID/stat`) and resident memory (`VmRSS`).
Then the client closes `--disconnect` connections at once, and the backend says when each of their requests
ended upstream.

Figures per target: RSS, CPU per relayed event (CPU time over the window ÷ events), the p50/p99 gap between
events and what the proxy adds to the direct p99, and the longest time from a client's close to the end of its
request at the backend.

    uv run python bench/streams.py [--streams 10000] [--window 10] [--disconnect 1000]

Needs root or a hard open-file limit above 3 × `--streams` (the driver raises it for its children where it can).
The backend and the client share one core, the proxy has the other (`taskset`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import BODY, NGINX_CONF, free_port, pinned, start_gateway, wait_http  # noqa: E402
from bench.overload import tree_cpu_s  # noqa: E402

CHUNK = (
    b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# -- the backend ----------------------------------------------------------------------------------------------


class _SlowStream(asyncio.Protocol):
    """One connection to the backend: `GET /health`, `GET /closed` (when each request's connection closed, by
    request id, `time.monotonic()` seconds), or a stream of one event per interval until the client leaves."""

    def __init__(self, interval_s: float, closed: dict[str, float]) -> None:
        self.interval_s = interval_s
        self.closed = closed
        self.buffer = b""
        self.request_id: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buffer[:head_end].decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
            elif name.strip().lower() == "x-request-id":
                self.request_id = value.strip()
        if len(self.buffer) < head_end + 4 + length:
            return
        self.buffer = self.buffer[head_end + 4 + length :]
        path = head.split(" ", 2)[1]
        if path in ("/health", "/closed"):
            payload = json.dumps(self.closed if path == "/closed" else {"status": "ok"}).encode()
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(payload), payload)
            )
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.tick()

    def tick(self) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(_chunked(CHUNK))
        self.timer = asyncio.get_running_loop().call_later(self.interval_s, self.tick)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.request_id is not None:
            self.closed[self.request_id] = time.monotonic()


async def _serve_backend(port: int, interval_s: float) -> None:
    closed: dict[str, float] = {}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _SlowStream(interval_s, closed), "127.0.0.1", port, backlog=16384)
    async with server:
        await server.serve_forever()


# -- the client -----------------------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    def __init__(self, run: _ClientRun, request_id: str, body: bytes) -> None:
        self.run = run
        self.request_id = request_id
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (request_id.encode(), len(body), body)
        )
        self.last: float | None = None
        self.first = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.last is None and data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 200"):
            if not self.first.done():
                self.first.set_exception(ConnectionError(data.split(b"\r\n", 1)[0].decode("latin-1")))
            return
        events = data.count(b"data: ")
        if not events:
            return
        now = time.monotonic()
        if self.run.measuring and self.last is not None:
            self.run.gaps.append(now - self.last)
            self.run.events += events
        self.last = now
        if not self.first.done():
            self.first.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError(f"closed before the first event: {exc!r}"))


class _ClientRun:
    def __init__(self) -> None:
        self.measuring = False
        self.gaps: list[float] = []
        self.events = 0


def _say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def _run_client(port: int, streams: int, window_s: float, disconnect: int) -> None:
    loop = asyncio.get_running_loop()
    run = _ClientRun()
    body = json.dumps({**BODY, "stream": True}).encode()
    clients: list[_Client] = []
    failed: list[_Client] = []
    started = time.monotonic()
    # Streams are opened 250 at a time, each batch once the last has its first events: ten thousand connections
    # opened at once overflow the stand-in backend's accept queue (its listen backlog is capped by
    # net.core.somaxconn), and the proxy's connections to it time out.
    for batch in range(0, streams, 250):
        pairs = await asyncio.gather(
            *(
                loop.create_connection(lambda i=i: _Client(run, f"s{i}", body), "127.0.0.1", port)  # type: ignore[misc]
                for i in range(batch, min(batch + 250, streams))
            )
        )
        opened = [protocol for _, protocol in pairs]
        outcomes = await asyncio.gather(*(c.first for c in opened), return_exceptions=True)
        for client, outcome in zip(opened, outcomes, strict=True):
            (clients if outcome is None else failed).append(client)
    _say(phase="open", open_s=time.monotonic() - started, failed=len(failed))
    await asyncio.sleep(1.0)
    run.measuring = True
    _say(phase="window")
    await asyncio.sleep(window_s)
    run.measuring = False
    _say(phase="measured")
    gaps = sorted(run.gaps)
    closing = clients[:disconnect]
    closed_at = {}
    for client in closing:
        assert client.transport is not None
        client.transport.close()
        closed_at[client.request_id] = time.monotonic()
    await asyncio.sleep(2.0)
    for client in clients[disconnect:]:
        assert client.transport is not None
        client.transport.close()
    _say(
        phase="done",
        events=run.events,
        gap_p50_s=gaps[len(gaps) // 2],
        gap_p99_s=gaps[int(len(gaps) * 0.99)],
        gap_max_s=gaps[-1],
        closed_at=closed_at,
    )


# -- the driver -----------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its children (nginx's worker), in MiB (`VmRSS`)."""
    total_kib = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(entry) == pid or int(fields.get("PPid", "0").strip() or 0) == pid:
            total_kib += int(fields.get("VmRSS", "0 kB").split()[0])
    return total_kib / 1024


def measure(
    port: int, pid: int, backend_port: int, *, streams: int, window_s: float, disconnect: int
) -> dict[str, float]:
    argv = [sys.executable, __file__, "--client", str(port), str(streams), str(window_s), str(disconnect)]
    client = subprocess.Popen(pinned(argv, 0), stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    result: dict[str, float] = {}
    cpu_before = 0.0
    for line in client.stdout:
        said = json.loads(line)
        if said["phase"] == "open":
            result["open_s"], result["failed"] = said["open_s"], said["failed"]
        elif said["phase"] == "window":
            cpu_before = tree_cpu_s(pid)
        elif said["phase"] == "measured":
            result["cpu_s"] = tree_cpu_s(pid) - cpu_before
            result["rss_mib"] = rss_mib(pid)
        elif said["phase"] == "done":
            result |= {k: said[k] for k in ("events", "gap_p50_s", "gap_p99_s", "gap_max_s")}
            import httpx

            ended = httpx.get(f"http://127.0.0.1:{backend_port}/closed", timeout=30).json()
            waits = [ended[rid] - t for rid, t in said["closed_at"].items() if rid in ended]
            result["upstream_closed"] = len(waits)
            result["close_max_s"] = max(waits) if waits else float("nan")
    client.wait(timeout=60)
    return result


def start_backend(interval_s: float) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(pinned([sys.executable, __file__, "--backend", str(port), str(interval_s)], 0))
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc, port


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--client", "--backend"):
        import uvloop

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if sys.argv[1] == "--backend":
            uvloop.run(_serve_backend(int(sys.argv[2]), float(sys.argv[3])))
        else:
            uvloop.run(_run_client(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between a stream's events")
    parser.add_argument("--window", type=float, default=10.0, help="measured seconds, all streams open")
    parser.add_argument("--disconnect", type=int, default=1000, help="clients that disconnect at once")
    parser.add_argument("--targets", default="direct,nginx,qiip")
    parser.add_argument(
        "--workers", type=int, default=1, help="QIIP's serving processes (server.workers); above 1, not pinned"
    )
    args = parser.parse_args()

    # Every stream is a client connection and a node connection (two on nginx and QIIP): raise the hard limit
    # for the children (as root), and the soft one to it.
    want = max(65_536, 4 * args.streams)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    state = tempfile.mkdtemp(prefix="qiip-streams-")
    procs: list[subprocess.Popen[bytes]] = []
    chosen = args.targets.split(",")
    print(
        f"{args.streams} streams, one event per {args.interval:g} s, {args.window:g} s measured, "
        f"{args.disconnect} disconnect at once; cpus {os.cpu_count()}"
    )
    header = (
        f"{'via':<7} | {'open s':>6} {'RSS MiB':>8} | {'events/s':>8} {'CPU/event':>9} | {'gap p50':>8} "
        f"{'gap p99':>8} {'added':>7} | {'closed':>6} {'close max':>9}"
    )
    print(header)
    print("-" * len(header))
    direct_p99: float | None = None
    try:
        for via in ("direct", "nginx", "qiip"):
            if via not in chosen:
                continue
            # A fresh backend per target, so its record of closed requests is this target's alone.
            backend, backend_port = start_backend(args.interval)
            procs.append(backend)
            if via == "direct":
                target, port = backend, backend_port
            elif via == "nginx":
                if shutil.which("nginx") is None:
                    continue
                port = free_port()
                workdir = Path(state) / "nginx"
                workdir.mkdir(exist_ok=True)
                conf = NGINX_CONF.format(prefix=workdir, backend=backend_port, port=port).replace(
                    "worker_connections 4096;", f"worker_connections {3 * args.streams};"
                )
                (workdir / "nginx.conf").write_text(f"worker_rlimit_nofile {want};\n" + conf)
                target = subprocess.Popen(
                    pinned(["nginx", "-c", str(workdir / "nginx.conf"), "-p", str(workdir), "-g", "daemon off;"], 1)
                )
                procs.append(target)
                wait_http(f"http://127.0.0.1:{port}/health")
            else:
                # Every client comes from 127.0.0.1, and every stream holds a node connection.
                connections = str(2 * args.streams)
                extra = {
                    "QIIP_SERVER__MAX_CONNECTIONS_PER_ADDRESS": connections,
                    "QIIP_UPSTREAM__MAX_CONNECTIONS": connections,
                    "QIIP_SERVER__WORKERS": str(args.workers),
                }
                core = 1 if args.workers == 1 else None
                target, port = start_gateway(backend_port, str(Path(state) / "qiip"), extra, core=core)
                procs.append(target)
            r = measure(
                port,
                target.pid,
                backend_port,
                streams=args.streams,
                window_s=args.window,
                disconnect=args.disconnect,
            )
            events_s = r["events"] / args.window
            cpu_us = r["cpu_s"] / r["events"] * 1e6 if r["events"] else float("nan")
            if via == "direct":
                direct_p99 = r["gap_p99_s"]
            added = f"{(r['gap_p99_s'] - direct_p99) * 1000:>5.1f}ms" if direct_p99 is not None else "      -"
            print(
                f"{via:<7} | {r['open_s']:>6.1f} {r['rss_mib']:>8.0f} | {events_s:>8.0f} {cpu_us:>7.1f}µs | "
                f"{r['gap_p50_s'] * 1000:>6.0f}ms {r['gap_p99_s'] * 1000:>6.0f}ms {added} | "
                f"{r['upstream_closed']:>6.0f} {r['close_max_s'] * 1000:>7.0f}ms",
                flush=True,
            )
            if r["failed"]:
                print(f"{'':<7}   {r['failed']:.0f} streams failed to open", flush=True)
                if via == "nginx":
                    print((Path(state) / "nginx" / "error.log").read_text()[-2000:], flush=True)
            for proc in (target, backend):
                proc.terminate()
                proc.wait(timeout=30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

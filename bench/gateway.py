"""Gateway overhead benchmark: the same load straight to a fast backend, through nginx, and through QIIP,
in one run.

Measures requests/s and latency (p50/p99) for non-streaming and streaming chat completions at
concurrency 1, 32 and 256 with `wrk`, and the time-to-first-byte overhead of streams with a sequential
raw-socket client, then prints each figure next to its direct baseline with the ratio. nginx (one worker,
keep-alive upstream, no buffering: a reverse proxy in C) shows what any proxy hop costs here.

The backend, the gateway and the load generator share this machine, so absolute numbers say little;
the ratios against the direct run are the result. CPU pinning (`taskset`) keeps the gateway on its own
core when there are two or more.

    uv run python bench/gateway.py [--duration 10] [--events 100]

Needs `wrk` (Debian package `wrk`); nginx is used when installed (Debian package `nginx-light`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pinned(argv: list[str], core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None or (os.cpu_count() or 1) < 2:
        return argv
    return ["taskset", "-c", str(core), *argv]


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer in time")


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float


_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert match, text
    return float(match.group(1)) * _UNITS[match.group(2)]


def run_wrk(url: str, *, connections: int, duration_s: int, stream: bool, core: int | None) -> WrkResult:
    body = json.dumps({**BODY, "stream": stream})
    script = f'wrk.method = "POST"\nwrk.body = {json.dumps(body)}\nwrk.headers["Content-Type"] = "application/json"\n'
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", f.name, url]
        out = subprocess.run(pinned(argv, core), capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    if "Non-2xx" in out or "Socket errors" in out:
        print(f"  warning: wrk reported errors against {url}:\n{out}", file=sys.stderr)
    return WrkResult(rps, p50, p99)


NGINX_CONF = """
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    # nginx closes a keep-alive connection after 1,000 requests by default, client side and upstream; a
    # closed-loop client that does not reconnect (bench/overload.py) would stop there.
    keepalive_requests 10000000;
    upstream node {{ server 127.0.0.1:{backend}; keepalive 256; keepalive_requests 10000000; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://node;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            client_body_temp_path {prefix}/body;
            proxy_temp_path {prefix}/proxy;
        }}
    }}
}}
"""


def start_nginx(backend_port: int, workdir: str) -> tuple[subprocess.Popen[bytes] | None, int]:
    if shutil.which("nginx") is None:
        return None, 0
    port = free_port()
    conf = Path(workdir) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(prefix=workdir, backend=backend_port, port=port))
    proc = subprocess.Popen(pinned(["nginx", "-c", str(conf), "-p", workdir, "-g", "daemon off;"], 1))
    return proc, port


def ttfb_ms(host: str, port: int, samples: int) -> list[float]:
    """Sequential streaming requests on one keep-alive connection: time until the first event's end."""
    body = json.dumps({**BODY, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    times = []
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(samples):
            started = time.perf_counter()
            sock.sendall(request)
            data = b""
            first = None
            while True:
                data += sock.recv(65536)
                if first is None and b"\n\n" in data.split(b"\r\n\r\n", 1)[-1]:
                    first = time.perf_counter()
                if data.endswith(b"0\r\n\r\n"):
                    break
            assert first is not None
            times.append((first - started) * 1000)
    return times


def start_gateway(
    backend_port: int,
    state: str,
    extra: dict[str, str],
    *,
    command: list[str] | None = None,
    source: str | None = None,
    core: int | None = 1,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a daemon (on one `core`, unless None) before the backend (model `bench`); wait until the node is healthy.

    Args:
        backend_port: the stand-in node's port on 127.0.0.1.
        state: the daemon's state directory (and working directory), created if missing.
        extra: more `QIIP_*` settings, over the defaults here.
        command: the daemon's command line without `--port` (default: `python -m qiip_proxy`).
        source: run another revision's code from this directory (a `git archive` of it).
        core: the CPU core to pin it to; None: any (several workers).

    Returns:
        The daemon's process and its port.

    Raises:
        RuntimeError: the node did not become healthy within 30 s.
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")}
    env |= {
        "QIIP_STATE_DIR": state,
        "QIIP_NODES": json.dumps([{"id": "bench", "endpoint": f"http://127.0.0.1:{backend_port}", "model": "bench"}]),
        "QIIP_LOGGING__LEVEL": "WARNING",
        "QIIP_ADMIN__ENABLED": "false",
        # One process on one core, unless `extra` asks for workers.
        "QIIP_SERVER__WORKERS": "1",
        # Every load-generator connection comes from 127.0.0.1.
        "QIIP_SERVER__MAX_CONNECTIONS_PER_ADDRESS": "100000",
        **extra,
    }
    if source is not None:
        env["PYTHONPATH"] = source
    Path(state).mkdir(parents=True, exist_ok=True)
    argv = command or [sys.executable, "-m", "qiip_proxy"]
    proc = subprocess.Popen(pinned([*argv, "--port", str(port)], core), env=env, cwd=state)
    wait_http(f"http://127.0.0.1:{port}/health")
    deadline = time.monotonic() + 30
    while httpx.get(f"http://127.0.0.1:{port}/health").json()["nodes_healthy"] < 1:
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError("the bench node never became healthy")
        time.sleep(0.05)
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--events", type=int, default=100, help="events per streamed response")
    parser.add_argument("--concurrency", default="1,32,256")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (Debian package `wrk`).")

    backend_port = free_port()
    backend = subprocess.Popen(
        pinned(
            [
                sys.executable,
                str(ROOT / "bench" / "backend.py"),
                "--port",
                str(backend_port),
                "--events",
                str(args.events),
            ],
            0,
        )
    )
    state = tempfile.mkdtemp(prefix="qiip-bench-")
    nginx, nginx_port = start_nginx(backend_port, state)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        if nginx is not None:
            wait_http(f"http://127.0.0.1:{nginx_port}/health")
        wait_http(f"http://127.0.0.1:{backend_port}/health")
        gateway, gateway_port = start_gateway(backend_port, state, {})
        print(f"backend :{backend_port}  gateway :{gateway_port}  {args.duration}s per run  cpus {os.cpu_count()}")
        print()
        header = (
            f"{'mode':<7} {'c':>4} {'via':<6} | {'rps':>7} {'ratio':>6} | {'p50':>8} {'added':>8} | "
            f"{'p99':>8} {'added':>8}"
        )
        print(header)
        print("-" * len(header))
        for stream in (False, True):
            for c in (int(x) for x in args.concurrency.split(",")):
                mode = "stream" if stream else "json"
                runs = (
                    [("direct", backend_port)] + ([("nginx", nginx_port)] if nginx else []) + [("qiip", gateway_port)]
                )
                results = {}
                for via, port in runs:
                    results[via] = run_wrk(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        connections=c,
                        duration_s=args.duration,
                        stream=stream,
                        core=0,
                    )
                direct = results["direct"]
                for via, result in results.items():
                    print(
                        f"{mode:<7} {c:>4} {via:<6} | {result.rps:>7.0f} {result.rps / direct.rps:>6.2f} | "
                        f"{result.p50_ms:>6.2f}ms {result.p50_ms - direct.p50_ms:>6.2f}ms | "
                        f"{result.p99_ms:>6.2f}ms {result.p99_ms - direct.p99_ms:>6.2f}ms"
                    )
                if stream:
                    events = {via: r.rps * (args.events + 1) for via, r in results.items()}
                    shares = ", ".join(f"{via} {e:.0f} ({e / events['direct']:.0%})" for via, e in events.items())
                    print(f"{'':<7} {'':>4} events/s: {shares}")
        direct_ttfb = ttfb_ms("127.0.0.1", backend_port, 300)
        gateway_ttfb = ttfb_ms("127.0.0.1", gateway_port, 300)
        print()
        d50, g50 = statistics.median(direct_ttfb), statistics.median(gateway_ttfb)
        d99 = statistics.quantiles(direct_ttfb, n=100)[98]
        g99 = statistics.quantiles(gateway_ttfb, n=100)[98]
        print(
            f"stream time to first event, c=1: direct p50 {d50:.3f}ms p99 {d99:.3f}ms; "
            f"through qiip p50 {g50:.3f}ms p99 {g99:.3f}ms; added p50 {g50 - d50:.3f}ms"
        )
    finally:
        for proc in (*([gateway] if gateway else []), backend, *([nginx] if nginx else [])):
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Another ASGI server for the same app: the daemon as it runs (uvicorn, its httptools protocol) against Granian (a
server in Rust) serving the very same QIIP app, one process each on the same core, in one run.

`wrk` sends non-streaming chat completions at concurrency 32 and 256 through each to a fast stand-in node; the
figure that counts is requests per proxy CPU-second (threads included, read from `/proc`). Granian is not a
dependency of the project: run this with it added for the run only.

    uv run --with granian==2.8.7 python bench/servers.py [--duration 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import free_port, pinned, run_wrk, start_gateway, wait_http  # noqa: E402
from bench.overload import tree_cpu_s  # noqa: E402
from bench.workers import start_backend, stop  # noqa: E402

APP = """from qiip_core.config import load_settings
from qiip_proxy._app import create_app, serving_app
from qiip_proxy._gateway import Gateway

app = serving_app(create_app(Gateway(load_settings(None))))
"""


def measure(name: str, port: int, pid: int, duration_s: int) -> None:
    for connections in (32, 256):
        before, started = tree_cpu_s(pid), time.monotonic()
        result = run_wrk(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            connections=connections,
            duration_s=duration_s,
            stream=False,
            core=0,
        )
        elapsed, cpu_s = time.monotonic() - started, tree_cpu_s(pid) - before
        print(
            f"{name:<8} c={connections:<4} {result.rps:>7.0f} req/s {result.rps * elapsed / cpu_s:>7.0f} req/CPU-s "
            f"p50 {result.p50_ms:>6.2f} ms p99 {result.p99_ms:>7.2f} ms"
        )


def start_granian(backend_port: int, state: Path) -> tuple[subprocess.Popen[bytes], int]:
    (state / "granian_app.py").write_text(APP)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")} | {
        "QIIP_NODES": json.dumps([{"id": "bench", "endpoint": f"http://127.0.0.1:{backend_port}", "model": "bench"}]),
        "QIIP_LOGGING__LEVEL": "WARNING",
        "QIIP_ADMIN__ENABLED": "false",
        "QIIP_SERVER__MAX_CONNECTIONS_PER_ADDRESS": "100000",
        "QIIP_STATE_DIR": str(state),
        "PYTHONPATH": str(state),
    }
    argv = [sys.executable, "-m", "granian", "--interface", "asgi", "--loop", "uvloop", "--workers", "1"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-ws", "granian_app:app"]
    proc = subprocess.Popen(pinned(argv, 1), env=env, cwd=state)
    wait_http(f"http://127.0.0.1:{port}/health")
    time.sleep(2.0)  # the node's first health probe
    return proc, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="uvicorn then Granian, this many times")
    args = parser.parse_args()
    backend_port = free_port()
    backend = start_backend(backend_port, events=16)
    try:
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="qiip-bench-servers-") as directory:
                state = Path(directory)
                daemon, port = start_gateway(backend_port, str(state / "uvicorn"), {})
                try:
                    measure("uvicorn", port, daemon.pid, args.duration)
                finally:
                    stop(daemon)
                granian, port = start_granian(backend_port, state)
                try:
                    measure("granian", port, granian.pid, args.duration)
                finally:
                    stop(granian)
    finally:
        stop(backend)


if __name__ == "__main__":
    main()

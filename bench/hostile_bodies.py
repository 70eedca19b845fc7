"""Hostile JSON bodies: how long `/health` waits while the daemon takes in what an unauthenticated client sent.

A daemon (one serving process on one core, no nodes, invoke tokens off: anyone may send) gets, on `--senders`
connections at once, bodies built to cost the most to parse within `--size-mib`:

- `keys`: one object of as many members as fit (`{"k0": 0, …}`), the costliest value to build (a dict entry);
- `elements`: an array of as many `0` as fit;
- `strings`: one string of escaped characters (`\\n`), within every bound: parsed whole, whatever it costs;
- `punctuation`: one string of `,` and `:`: within every bound once measured, past all of them at a glance.

Meanwhile a prober sends `GET /health` back to back on its own connection and records each latency. The baseline,
from the same run, is `/health` on the idle daemon. With `--baseline REV` the same load also runs against that
revision's code (`git archive`), so the figures compare with what the daemon did before.

    uv run python bench/hostile_bodies.py [--size-mib 16] [--senders 2] [--rounds 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway import free_port, pinned, wait_http  # noqa: E402


def bodies(size: int) -> dict[str, bytes]:
    """The hostile bodies of about `size` bytes each, by kind."""
    members = size // 16
    return {
        "keys": b'{"model": "m", "x": {' + b",".join(b'"k%d": 0' % i for i in range(members)) + b"}}",
        "elements": b'{"model": "m", "input": [' + b",".join([b"0"] * (size // 2)) + b"]}",
        "strings": b'{"model": "m", "prompt": "' + b"\\n" * (size // 2) + b'"}',
        "punctuation": json.dumps({"model": "m", "prompt": ",:" * (size // 2)}).encode(),
    }


def start(state: str, source: str | None, max_body_bytes: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")}
    env |= {
        "QIIP_STATE_DIR": state,
        "QIIP_LOGGING__LEVEL": "WARNING",
        "QIIP_ADMIN__ENABLED": "false",
        "QIIP_SERVER__WORKERS": "1",
        "QIIP_SERVER__MAX_BODY_BYTES": str(max_body_bytes),
    }
    if source is not None:
        env["PYTHONPATH"] = source
    Path(state).mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(pinned([sys.executable, "-m", "qiip_proxy", "--port", str(port)], 1), env=env, cwd=state)
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc, port


def probe(port: int, until: threading.Event, latencies: list[float]) -> None:
    """`GET /health` back to back on one connection until `until` is set; each latency in seconds."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while not until.is_set():
        started = time.perf_counter()
        connection.request("GET", "/health", headers={"Host": "localhost"})
        connection.getresponse().read()
        latencies.append(time.perf_counter() - started)
    connection.close()


def send(port: int, body: bytes, statuses: list[int]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Host": "localhost"})
    response = connection.getresponse()
    response.read()
    statuses.append(response.status)
    connection.close()


def measure(port: int, body: bytes | None, senders: int, rounds: int) -> tuple[list[float], list[int]]:
    """`/health` latencies while `senders` connections each send `body` (`rounds` times); idle when None."""
    latencies: list[float] = []
    statuses: list[int] = []
    done = threading.Event()
    prober = threading.Thread(target=probe, args=(port, done, latencies))
    prober.start()
    if body is None:
        time.sleep(2.0)
    else:
        for _ in range(rounds):
            threads = [threading.Thread(target=send, args=(port, body, statuses)) for _ in range(senders)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    done.set()
    prober.join()
    return latencies, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=16.0, help="size of each hostile body (MiB)")
    parser.add_argument("--senders", type=int, default=2, help="connections sending hostile bodies at once")
    parser.add_argument("--rounds", type=int, default=3, help="bodies each sender sends, one after the other")
    parser.add_argument("--baseline", metavar="REV", help="also run this revision's code, e.g. main")
    args = parser.parse_args()
    size = int(args.size_mib * 1024 * 1024)
    kinds = bodies(size)
    with tempfile.TemporaryDirectory(prefix="qiip-hostile-") as state:
        targets: list[tuple[str, str | None]] = [("this", None)]
        if args.baseline:
            extracted = Path(state) / "baseline-src"
            extracted.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(extracted)], input=archive.stdout, check=True)
            targets.append((args.baseline[:12], str(extracted)))
        print(f"bodies of {args.size_mib:g} MiB, {args.senders} senders x {args.rounds} rounds; /health latency in ms")
        print(f"{'target':>12} {'body':>12} {'statuses':>18} {'n':>6} {'p50':>8} {'p99':>8} {'max':>8} {'max/idle':>9}")
        for name, source in targets:
            proc, port = start(f"{state}/{name}", source, max(size + 1024, 1 << 20))
            try:
                idle, _ = measure(port, None, 0, 0)
                idle_p50 = statistics.median(idle)
                rows: list[tuple[str, list[float], list[int]]] = [("idle", idle, [])]
                for kind, body in kinds.items():
                    latencies, statuses = measure(port, body, args.senders, args.rounds)
                    rows.append((kind, latencies, statuses))
                for kind, latencies, statuses in rows:
                    ordered = sorted(latencies)
                    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
                    counts = ",".join(f"{s}x{statuses.count(s)}" for s in sorted(set(statuses))) or "-"
                    print(
                        f"{name:>12} {kind:>12} {counts:>18} {len(ordered):>6} {statistics.median(ordered) * 1e3:>8.1f}"
                        f" {p99 * 1e3:>8.1f} {ordered[-1] * 1e3:>8.1f} {ordered[-1] / idle_p50:>9.0f}"
                    )
            finally:
                proc.terminate()
                proc.wait(30)


if __name__ == "__main__":
    main()

"""Chaos: what clients see while nodes blip, die and freeze.

Three fault-injecting nodes serve one model behind a real daemon; `--clients` clients stream chat answers
without pause. First a calm phase (the baseline: no faults), then the chaos phase, in which:

- every `--blip-every` seconds one node, never two at once, stops accepting connections for a few
  milliseconds (a restarting listener, a full accept queue);
- a third of the way in, one node dies (`kill -9`: its connections are reset and it refuses new ones) and
  comes back 2 s later;
- two thirds of the way in, one node freezes (sockets open, nothing answered, `/health` included) for 4 s.

Printed per phase: requests, client-visible errors per 10,000 requests (a status other than 200, or a stream
without `[DONE]` or with an error event), and seconds of model unavailability (100 ms slots in which requests
ended and none succeeded). Streams that a killed node was serving end with an error event by design; they are
counted apart. Target: 0 other errors and 0 s while any node can serve.

    uv run python bench/chaos.py --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.daemon import Daemon  # noqa: E402
from tests.support.fault_backend import Completion, FaultBackend, Hang, Json  # noqa: E402

MODEL = "chaos"
SETTINGS = {
    # Defaults, except the first-token limit (a frozen node's requests fail over through its probes, not
    # by waiting out 120 s) and probes a little faster than the 10 s default so a 4 s freeze is seen.
    "QIIP_UPSTREAM__TTFB_TIMEOUT_S": "30",
    "QIIP_UPSTREAM__GENERATION_TIMEOUT_S": "30",
    "QIIP_HEALTH__INTERVAL_S": "2",
    "QIIP_HEALTH__TIMEOUT_S": "1",
    "QIIP_HEALTH__FAILURE_THRESHOLD": "2",
    "QIIP_HEALTH__RETRY_INTERVAL_S": "0.5",
    "QIIP_BREAKER__FAILURE_THRESHOLD": "3",
    "QIIP_BREAKER__OPEN_S": "1",
    "QIIP_HEALTH__RECOVERY_TIMEOUT_S": "5",
    "QIIP_UPSTREAM__CONNECT_TIMEOUT_S": "2",
    "QIIP_UPSTREAM__IDLE_TIMEOUT_S": "30",
}


@dataclass
class Tally:
    """What the clients saw in one phase."""

    requests: int = 0
    errors: int = 0
    cut_by_kill: int = 0
    slots: dict[int, list[bool]] = field(default_factory=dict)

    def record(self, ok: bool, *, killed: bool = False) -> None:
        self.requests += 1
        if not ok:
            if killed:
                self.cut_by_kill += 1
            else:
                self.errors += 1
        self.slots.setdefault(int(time.monotonic() * 10), []).append(ok)

    def unavailable_s(self) -> float:
        return sum(0.1 for outcomes in self.slots.values() if not any(outcomes))


async def client_loop(url: str, stop: float, tally: Tally, killing: threading.Event) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while time.monotonic() < stop:
            killed_during = killing.is_set()
            try:
                answer = await client.post("/v1/chat/completions", json=body)
                ok = (
                    answer.status_code == 200
                    and answer.text.endswith("data: [DONE]\n\n")
                    and '"error"' not in answer.text
                )
            except httpx.HTTPError:
                ok = False
            tally.record(ok, killed=killed_during or killing.is_set())


def chaos(nodes: list[FaultBackend], stop: float, blip_every_s: float, killing: threading.Event) -> None:
    """Inject the faults from a thread, on the clock, until `stop`."""
    rng = random.Random(1)
    start = time.monotonic()
    span = stop - start
    killed = frozen = False
    while time.monotonic() < stop:
        now = time.monotonic() - start
        if not killed and now >= span / 3:
            killed = True
            victim = nodes[0]
            killing.set()
            victim.stop_listening(drop_connections=True)
            time.sleep(2)
            victim.start_listening()
            time.sleep(0.5)
            killing.clear()
            continue
        if not frozen and now >= 2 * span / 3:
            frozen = True
            victim = nodes[1]
            victim.health, victim.default = Hang(), Hang()
            time.sleep(4)
            victim.health, victim.default = Json(200, {"status": "ok"}), Completion()
            continue
        node = rng.choice(nodes)
        node.stop_listening()
        time.sleep(0.005)
        node.start_listening()
        time.sleep(blip_every_s)


async def phase(url: str, clients: int, duration_s: float, killing: threading.Event) -> Tally:
    tally = Tally()
    stop = time.monotonic() + duration_s
    await asyncio.gather(*(client_loop(url, stop, tally, killing) for _ in range(clients)))
    return tally


def report(name: str, tally: Tally) -> None:
    per_10k = 10_000 * tally.errors / max(1, tally.requests)
    print(
        f"{name:>6}: {tally.requests:6d} requests, {per_10k:7.1f} errors per 10,000 "
        f"({tally.errors} errors; {tally.cut_by_kill} streams cut by the kill), "
        f"{tally.unavailable_s():.1f} s unavailable"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of chaos (the calm phase: a quarter)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--blip-every", type=float, default=0.25, help="seconds between two listener blips")
    args = parser.parse_args()
    nodes = [FaultBackend(model=MODEL) for _ in range(3)]
    killing = threading.Event()
    with tempfile.TemporaryDirectory() as directory:
        with Daemon(Path(directory), env=SETTINGS) as daemon:
            for index, node in enumerate(nodes):
                daemon.add_node(f"chaos-{index}", node.url, MODEL)
            calm = asyncio.run(phase(daemon.url, args.clients, args.duration / 4, killing))
            injector = threading.Thread(
                target=chaos, args=(nodes, time.monotonic() + args.duration, args.blip_every, killing), daemon=True
            )
            injector.start()
            stormy = asyncio.run(phase(daemon.url, args.clients, args.duration, killing))
            injector.join()
    for node in nodes:
        node.close()
    print(f"3 nodes, {args.clients} streaming clients, a blip every {args.blip_every:g} s")
    report("calm", calm)
    report("chaos", stormy)


if __name__ == "__main__":
    main()

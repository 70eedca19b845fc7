"""Provisioning at scale: 32 concurrent setups against loopback hosts, and how responsive the daemon's API stays.

One real OpenSSH `sshd` stands for `--hosts` hosts on 127.0.0.2 and up (the test suite's `SshHosts`: GPU hosts
whose `nvidia-smi`, package manager, driver installer and vLLM are stubs, everything else real). The daemon sets
them all up at once (vLLM, GPU profile: preflight, upload, the bundle's setup script, GPU check, engine start,
health, registration) while a client times `GET /health` one request after another. The same client first times
`/health` on the idle daemon: the baseline of the same run.

Printed: setups succeeded and the time they took, and `/health` p50/p99 during the run against idle, as ratios.
One OpenSSH `sshd` listens on at most 16 addresses (its MAX_LISTEN_SOCKS): past 16 hosts, several sshd share the
port, the client key and one known-hosts file.

    uv run python bench/provisioning.py [--hosts 32]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.daemon import Daemon, free_port  # noqa: E402
from tests.support.sshd import DRIVER_VERSION, DriverServer, SshHosts  # noqa: E402


def health_latencies_s(client: httpx.Client, *, until: float | None = None, count: int = 300) -> list[float]:
    """Time `GET /health` one after another: `count` times, or until the monotonic time `until`."""
    samples: list[float] = []
    while (until is None and len(samples) < count) or (until is not None and time.monotonic() < until):
        started = time.perf_counter()
        client.get("/health").raise_for_status()
        samples.append(time.perf_counter() - started)
    return samples


def start_hosts(base: Path, count: int, stack: contextlib.ExitStack) -> list[SshHosts]:
    """`count` loopback hosts, 16 per sshd (its limit), all on the first group's port, with its client key and
    one known-hosts file (the first group's) naming every host."""
    groups: list[SshHosts] = []
    for index, first in enumerate(range(0, count, 16)):
        group = SshHosts(base / f"ssh{index}", min(16, count - first), first=2 + first)
        if groups:
            group.port = groups[0].port
            group.base.mkdir(parents=True, exist_ok=True)
            for suffix in ("", ".pub"):
                shutil.copy(str(groups[0].client_key) + suffix, str(group.client_key) + suffix)
        stack.enter_context(group)
        groups.append(group)
    groups[0].known_hosts.write_text("".join(group.known_hosts.read_text() for group in groups))
    return groups


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=32, help="loopback hosts (127.0.0.2 and up)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the setups may take in all")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        base = Path(directory)
        with DriverServer(base / "driver") as driver, contextlib.ExitStack() as stack:
            groups = start_hosts(base, args.hosts, stack)
            hosts, all_hosts = groups[0], [host for group in groups for host in group.hosts]
            for host in all_hosts:
                host.preinstall_vllm()
            env = {
                "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
                "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
                "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
                "QIIP_PROVISIONING__ENGINE_PORT": str(free_port()),
                "QIIP_PROVISIONING__NVIDIA_DRIVER_VERSION": DRIVER_VERSION,
                "QIIP_PROVISIONING__NVIDIA_DRIVER_SHA256": driver.sha256,
                "QIIP_PROVISIONING__NVIDIA_DRIVER_URL_TEMPLATE": driver.url_template,
                "QIIP_PROVISIONING__MIN_FREE_DISK_GIB": "0.01",
                "QIIP_PROVISIONING__HEALTH_INTERVAL_S": "0.2",
                "QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS": str(args.hosts),
                "QIIP_LOGGING__LEVEL": "WARNING",
            }
            with Daemon(base / "state", env=env) as daemon, httpx.Client(base_url=daemon.url, timeout=30) as client:
                idle = health_latencies_s(client)
                started = time.monotonic()
                operations = []
                for host in all_hosts:
                    body = {"hostname": host.address, "engine": "vllm", "model": "org/model"}
                    answer = daemon.admin.post("/admin/nodes/setup", json=body)
                    answer.raise_for_status()
                    operations.append(answer.json()["id"])
                busy: list[float] = []
                states: dict[str, str] = {}
                deadline = started + args.timeout
                while time.monotonic() < deadline:
                    busy += health_latencies_s(client, until=time.monotonic() + 1.0)
                    states = {op: daemon.admin.get(f"/admin/operations/{op}").json()["state"] for op in operations}
                    if all(state not in ("pending", "running") for state in states.values()):
                        break
                took_s = time.monotonic() - started
    succeeded = sum(state == "succeeded" for state in states.values())
    print(f"{args.hosts} concurrent setups (vLLM, GPU profile, loopback sshd): {succeeded} succeeded in {took_s:.1f} s")
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        idle_s, busy_s = quantile(idle, q), quantile(busy, q)
        print(
            f"GET /health {name}: idle {idle_s * 1000:.2f} ms, during setups {busy_s * 1000:.2f} ms "
            f"({busy_s / idle_s:.1f}x)"
        )
    print(f"({len(idle)} idle and {len(busy)} busy samples; median idle {statistics.median(idle) * 1000:.2f} ms)")


if __name__ == "__main__":
    main()

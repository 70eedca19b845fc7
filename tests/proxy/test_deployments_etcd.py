"""Two gateways on one real etcd share a deployment: the one whose controller leads is killed (`kill -9`) while a
replica of a rollout's new template is being set up, and the other takes the leadership over and completes the
rollout.

The hosts are real sshd hosts on loopback (127.0.0.70–73) with the project's CPU llama-server and tiny generated
models. The new replica's setup is held in its remote preflight (`lspci`), so the kill lands mid-setup, never by
luck. Through the whole rollout a sampler records what the shared status says (replicas in all, ready ones) and what
each host runs (the process groups operations record beside the node bundle, by operation), and a client loop
sends requests through the surviving gateway.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from base64 import b64decode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from qiip_core.catalog import scan_catalog
from qiip_core.engines.llamacpp import make_test_gguf
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.etcd import EtcdServer
from tests.support.hf_cache import HfCacheBuilder
from tests.support.provisioning import TINY_REPO, TINY_SIZING, cpu_hosts, daemon_env
from tests.support.rollouts import ClientLoop, deployment, settled, status_of
from tests.support.sshd import FakeHost, SshHosts

pytestmark = pytest.mark.integration

FIRST = 70
"""The hosts are 127.0.0.70–73: two replicas, and room for the surge and a failed setup."""
TINY_REPO_B = "qiip-test/tiny-b-GGUF"
LEADER_TTL_S = 3
REPLICAS = 2
MAX_SURGE = 1


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path) -> Iterator[SshHosts]:
    models = tmp_path_factory.mktemp("etcd-deploy-models")
    other = make_test_gguf(tmp_path_factory.mktemp("etcd-deploy-b") / "tiny-b.gguf", seed=1)[0]
    HfCacheBuilder(models).add_file(TINY_REPO_B, "b" * 40, "tiny-b-Q8_0.gguf", source=other)
    yield from cpu_hosts(
        tmp_path_factory.mktemp("etcd-deploy-ssh"), models, llama_server_binary, tiny_gguf, count=4, first=FIRST,
        holdable=False,
    )  # fmt: skip


def operations_on(host: FakeHost) -> set[str]:
    """The operations with a live process group on `host` now (each command's tag starts with its operation's
    id); a new operation's command that ends a dead gateway's runs is not counted: it is how a takeover begins."""
    runs = host.root / "var" / "lib" / "qiip-node" / "runs"
    found = set()
    for entry in runs.iterdir() if runs.is_dir() else ():
        try:
            tag = entry.read_text()
            os.killpg(int(entry.name), 0)
        except (ValueError, OSError):
            continue
        if "ending earlier runs" not in tag:
            found.add(tag.split(" ", 1)[0])
    return found


@dataclass
class Sampler:
    """On a thread: the shared status's replicas (most in all, fewest ready) and each host's operations."""

    daemon: Daemon
    hosts: SshHosts
    most_replicas: int = 0
    fewest_ready: int = REPLICAS
    overlaps: list[str] = field(default_factory=list)
    samples: int = 0
    widest: list[str] = field(default_factory=list)
    """The replicas when they were most (host, state, template)."""
    seen: dict[str, set[str]] = field(default_factory=dict)
    """Every operation seen running on each host."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        for host in self.hosts.hosts:
            running = operations_on(host)
            self.seen.setdefault(host.address, set()).update(running)
            if len(running) > 1:
                self.overlaps.append(f"{host.address}: {sorted(running)}")
        try:
            replicas = status_of(self.daemon, "coder").get("replicas", [])
        except (httpx.HTTPError, AssertionError):
            return
        if len(replicas) > self.most_replicas:
            self.widest = [f"{r['host']} {r['state']} {r['template'][:6]}" for r in replicas]
        self.most_replicas = max(self.most_replicas, len(replicas))
        self.fewest_ready = min(self.fewest_ready, sum(1 for r in replicas if r["state"] == "ready"))
        self.samples += 1

    def __enter__(self) -> Sampler:
        def run() -> None:
            while not self._stop.wait(0.05):
                self.sample()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)


def leader_record(etcd: EtcdServer) -> dict[str, object] | None:
    """The controller's leader key (`/deployments/leader`): its owner and etcd lease, or None while none leads."""
    kvs = etcd.range_prefix(b"/deployments/leader")
    if not kvs:
        return None
    return {**json.loads(b64decode(kvs[0]["value"])), "lease": int(kvs[0].get("lease", 0))}


def granted_ttl_s(etcd: EtcdServer, lease: int) -> int:
    answer = httpx.post(etcd.url + "/v3/lease/timetolive", json={"ID": lease}, timeout=10)
    answer.raise_for_status()
    return int(answer.json().get("grantedTTL", 0))


def test_the_other_gateway_completes_a_rollout_whose_controller_was_killed_mid_setup(
    hosts: SshHosts, etcd: EtcdServer, tmp_path: Path
) -> None:
    artifacts = {g.repo_id: g.artifact_id for g in scan_catalog(hosts.models).gguf}  # type: ignore[attr-defined]
    pool = [{"name": h.address, "memory_mib": 4096} for h in hosts.hosts]
    env = daemon_env(
        hosts,
        free_port(),
        QIIP_HOSTS=json.dumps(pool),
        QIIP_REGISTRY__BACKEND="etcd",
        QIIP_ETCD__ENDPOINTS=json.dumps([etcd.url]),
        QIIP_PROVISIONING__HOST_LEASE_TTL_S="5",
        QIIP_DEPLOYMENTS__LEADER_TTL_S=str(LEADER_TTL_S),
        QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S="0.3",
        QIIP_DEPLOYMENTS__FAILURE_BACKOFF_S="1",
        # One failed replica of the new template would pause the rollout: the setup the kill cut must not count.
        QIIP_DEPLOYMENTS__ROLLOUT_MAX_FAILURES="1",
        QIIP_HEALTH__INTERVAL_S="0.3",
        QIIP_HEALTH__FAILURE_THRESHOLD="2",
    )
    gateways = [Daemon(tmp_path / "a", env=env).start(), Daemon(tmp_path / "b", env=env).start()]
    try:
        spec = {
            "name": "coder",
            "replicas": REPLICAS,
            "source": {"artifact": artifacts[TINY_REPO]},
            "runtime": {"sizing": TINY_SIZING},
            "update": {"max_surge": MAX_SURGE, "max_unavailable": 0},
        }
        answer = gateways[0].admin.put("/admin/deployments/coder", json=spec)
        assert answer.status_code == 201, answer.text
        wait_until(lambda: settled(gateways[1], "coder", REPLICAS), 240, "two ready replicas")

        # The leader, from the status its controller wrote and the leader key in etcd; the other one survives.
        owner = status_of(gateways[1], "coder")["controller"]
        record = leader_record(etcd)
        assert record is not None and record["owner"] == owner
        assert granted_ttl_s(etcd, int(str(record["lease"]))) == LEADER_TTL_S
        names = {f"{socket.gethostname()}:{g.port}": g for g in gateways}
        leader = names[owner]
        survivor = next(g for g in gateways if g is not leader)

        old = deployment(survivor, "coder")["template"]["hash"]
        serving = {r["host"] for r in status_of(survivor, "coder")["replicas"]}
        spares = [h for h in hosts.hosts if h.address not in serving]
        for host in spares:
            host.hold("lspci")
        with ClientLoop(survivor.url, "coder") as loop, Sampler(survivor, hosts) as sampler:
            answer = survivor.admin.post(
                "/admin/deployments/coder/rollout", json={"source": {"artifact": artifacts[TINY_REPO_B]}}
            )
            assert answer.status_code == 200, answer.text
            new = answer.json()["template"]["hash"]
            assert new != old

            def provisioning_new() -> str | None:
                for r in status_of(survivor, "coder").get("replicas", []):
                    if r["template"] == new and r["state"] == "provisioning":
                        return str(r["host"])
                return None

            wait_until(lambda: provisioning_new() is not None, 120, "a replica of the new template provisioning")
            held = next(h for h in spares if h.address == provisioning_new())
            wait_until(lambda: held.held_pid("lspci") is not None, 60, "the new replica's setup held in preflight")
            assert leader.stop(signal.SIGKILL) == -signal.SIGKILL
            for host in spares:
                host.release("lspci")

            # The survivor campaigns every pass: it leads once the dead leader's lease lapses (one TTL).
            wait_until(lambda: (leader_record(etcd) or {}).get("owner") == f"{socket.gethostname()}:{survivor.port}",
                       60, "the survivor to lead")  # fmt: skip
            wait_until(lambda: settled(survivor, "coder", REPLICAS), 300, "the rollout to complete")
            assert status_of(survivor, "coder")["controller"] == f"{socket.gethostname()}:{survivor.port}"
        final = status_of(survivor, "coder")
        assert final["rollout"]["failures"] == 0 and held.address not in final["host_failures"], final["rollout"]
        assert {r["template"] for r in final["replicas"]} == {new}
        # The sampler saw the operations it judges: the dead gateway's held setup, then the survivor's.
        assert sampler.seen.get(held.address) and sum(map(len, sampler.seen.values())) >= 4, sampler.seen
        assert not sampler.overlaps, sampler.overlaps
        assert sampler.most_replicas <= REPLICAS + MAX_SURGE, sampler.widest
        assert sampler.fewest_ready >= REPLICAS, sampler.fewest_ready
        assert loop.failed == 0, loop.errors
        # The old replicas were drained and torn down: no node of the old template is left, on either record.
        nodes = survivor.admin.get("/admin/nodes").json()["nodes"]
        coder_nodes = {n["id"] for n in nodes if (n.get("deployment") or {}).get("name") == "coder"}
        assert coder_nodes == {r["host"] for r in final["replicas"]}, coder_nodes
        events = [e["kind"] for e in final["events"]]
        assert "torn_down" in events, events
        log = survivor.log()
        assert f"provisioning of {held.address} was interrupted" in log  # taken over, not left running
        assert "Traceback" not in log and "a deployment pass failed" not in log, log[-4000:]
    finally:
        for host in hosts.hosts:
            host.release("lspci")
        for gateway in gateways:
            gateway.close()

"""Several gateways on one etcd: one view of the fleet, and serving through an etcd outage."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, wait_until
from tests.support.etcd import EtcdServer
from tests.support.fault_backend import FaultBackend

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]


def etcd_env(etcd: EtcdServer) -> dict[str, str]:
    return {"QIIP_REGISTRY__BACKEND": "etcd", "QIIP_ETCD__ENDPOINTS": json.dumps([etcd.url])}


@pytest.fixture
def gateways(etcd: EtcdServer, tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    env = etcd_env(etcd) | {"QIIP_ETCD__RECONNECT_MAX_BACKOFF_S": "0.5"}
    with Daemon(tmp_path / "gw1", env=env) as one, Daemon(tmp_path / "gw2", env=env) as two:
        yield one, two


def test_two_gateways_converge_on_puts_and_deletes(
    gateways: tuple[Daemon, Daemon], etcd: EtcdServer, backends: Backends, tmp_path: Path
) -> None:
    backend = backends()
    added = run_qiip(tmp_path, "node", "add", "gpu01", backend.url, "--model", "shared/model", env=etcd_env(etcd))
    assert added.returncode == 0, added.stderr
    for gateway in gateways:
        gateway.wait_status("gpu01", "healthy")
        answer = httpx.post(gateway.url + "/v1/chat/completions", json={"model": "shared/model", "messages": []})
        assert answer.status_code == 200
    listed = json.loads(run_qiip(tmp_path, "node", "list", "--json", env=etcd_env(etcd)).stdout)
    assert [(n["id"], n["source"]) for n in listed] == [("gpu01", "etcd")]
    removed = run_qiip(tmp_path, "node", "remove", "gpu01", env=etcd_env(etcd))
    assert removed.returncode == 0, removed.stderr
    for gateway in gateways:
        gateway.wait_gone("gpu01")


def test_requests_are_served_through_an_etcd_outage(
    gateways: tuple[Daemon, Daemon], etcd: EtcdServer, backends: Backends, tmp_path: Path
) -> None:
    one, two = gateways
    backend = backends()
    assert run_qiip(tmp_path, "node", "add", "gpu01", backend.url, "--model", "m", env=etcd_env(etcd)).returncode == 0
    one.wait_status("gpu01", "healthy")
    failures: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                status = client.post(one.url + "/v1/chat/completions", json={"model": "m", "messages": []}).status_code
                if status != 200:
                    failures.append(status)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        etcd.stop()
        wait_until(lambda: one.client.get("/health").json()["status"] == "degraded", what="a degraded registry")
        status = run_qiip(tmp_path, "registry", "status", env=etcd_env(etcd))
        assert status.returncode == 1 and "degraded" in status.stdout
        etcd.start()
        wait_until(lambda: one.client.get("/health").json()["status"] == "ok", what="the registry to recover")
    finally:
        stop.set()
        thread.join(30)
    assert failures == []
    other = backends()
    assert run_qiip(tmp_path, "node", "add", "gpu02", other.url, "--model", "m", env=etcd_env(etcd)).returncode == 0
    for gateway in (one, two):
        gateway.wait_status("gpu02", "healthy")
    status = run_qiip(tmp_path, "registry", "status", env=etcd_env(etcd))
    assert status.returncode == 0 and "backend: etcd" in status.stdout and "nodes:   2" in status.stdout


def test_a_gateway_started_while_etcd_is_down_serves_the_fleet_it_last_knew(
    etcd: EtcdServer, backends: Backends, tmp_path: Path
) -> None:
    env = etcd_env(etcd) | {"QIIP_ETCD__RECONNECT_MAX_BACKOFF_S": "0.5"}
    first, second = backends(), backends()
    assert run_qiip(tmp_path, "node", "add", "gpu01", first.url, "--model", "m", env=env).returncode == 0
    saved = tmp_path / "gw" / "etcd-fleet.json"
    with Daemon(tmp_path / "gw", env=env) as gateway:
        gateway.wait_status("gpu01", "healthy")
        wait_until(lambda: saved.exists() and '"gpu01"' in saved.read_text(), what="the fleet to be saved")
    # While the gateway is down the fleet changes; then etcd goes down too.
    assert run_qiip(tmp_path, "node", "remove", "gpu01", env=env).returncode == 0
    assert run_qiip(tmp_path, "node", "add", "gpu02", second.url, "--model", "m", env=env).returncode == 0
    etcd.stop()
    # A gateway that never read the fleet has nothing to route: its /health fails, for the load balancer.
    fresh = Daemon(tmp_path / "fresh", env=env).start(healthy=False)
    try:
        answer = fresh.client.get("/health")
        assert answer.status_code == 503 and answer.json()["status"] == "unavailable"
        assert answer.json()["registry"]["last_known_at"] is None
    finally:
        fresh.close()
    # The one that did serves what it last knew, and says so.
    with Daemon(tmp_path / "gw", env=env) as gateway:
        gateway.wait_status("gpu01", "healthy")
        assert httpx.post(gateway.url + "/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 200
        health = gateway.client.get("/health").json()
        assert health["status"] == "degraded" and health["registry"]["last_known_at"] is not None
        assert "Serving the last known fleet (1 node(s), saved " in health["registry"]["detail"]
        assert "Serving the last known fleet until it answers: 1 node(s)" in gateway.log()
        # etcd back: its fleet replaces the saved one.
        etcd.start()
        gateway.wait_status("gpu02", "healthy")
        gateway.wait_gone("gpu01")
        health = gateway.client.get("/health").json()
        assert health["status"] == "ok" and health["registry"]["last_known_at"] is None
        wait_until(lambda: '"gpu02"' in saved.read_text() and '"gpu01"' not in saved.read_text(), what="a new save")


def test_a_managed_node_nobody_can_reach_expires(
    gateways: tuple[Daemon, Daemon], etcd: EtcdServer, backends: Backends
) -> None:
    import etcd3gw

    one, two = gateways
    client = etcd3gw.client(host="127.0.0.1", port=etcd.client_port, timeout=5)
    reachable = backends()
    lease_alive = client.lease(ttl=6)
    managed = {"model": "m", "engine": "llama_cpp", "managed": True}
    client.put("/nodes/alive", json.dumps({"endpoint": reachable.url, **managed}), lease=lease_alive)
    lease_dead = client.lease(ttl=3)
    client.put("/nodes/dead", json.dumps({"endpoint": "http://127.0.0.1:1", **managed}), lease=lease_dead)
    for gateway in (one, two):
        gateway.wait_status("alive", "healthy")
        wait_until(lambda g=gateway: "dead" in g.node_statuses(), what="the dead node to appear")  # type: ignore[misc]
    for gateway in (one, two):
        gateway.wait_gone("dead")
    # The reachable node's lease was refreshed by the gateways' probes: it outlives its 6 s TTL.
    assert lease_alive.ttl() > 3
    assert "alive" in one.node_statuses() and "alive" in two.node_statuses()

"""Autoscaling on a real daemon and real sshd hosts on loopback (the cpu profile, the project's llama-server, a tiny
generated model in a shared Hugging Face cache), with client loops through the gateway counting every answer that
is not 200.

One daemon and four hosts serve the module's tests in order: load scales a deployment up and back down (and
recommend mode only says so), fifty first requests start one replica of a deployment at zero, and a deployment at
zero that no host can hold answers 503 within its bound. Each test waits for the state it asserts (a replica ready,
a recommendation in the status), never for a duration.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core.catalog import scan_catalog
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.provisioning import TINY_REPO, TINY_SIZING, cpu_hosts, daemon_env
from tests.support.rollouts import ClientLoop, deployment, settled, status_of
from tests.support.sshd import SshHosts

pytestmark = pytest.mark.integration

FIRST = 80
"""The hosts are 127.0.0.80–83: three replicas at the most, and room for one more."""


@dataclass
class Fleet:
    daemon: Daemon
    hosts: SshHosts
    artifact: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path) -> Iterator[Fleet]:
    models = tmp_path_factory.mktemp("autoscale-models")
    hosts_iter = cpu_hosts(
        tmp_path_factory.mktemp("autoscale-ssh"), models, llama_server_binary, tiny_gguf, count=4, first=FIRST,
        holdable=False,
    )  # fmt: skip
    hosts = next(hosts_iter)
    artifact = next(g.artifact_id for g in scan_catalog(models).gguf if g.repo_id == TINY_REPO)
    pool = [{"name": h.address, "memory_mib": 4096, "labels": {"rack": "r1"}} for h in hosts.hosts]
    env = daemon_env(
        hosts,
        free_port(),
        QIIP_HOSTS=json.dumps(pool),
        QIIP_DEPLOYMENTS__RECONCILE_INTERVAL_S="0.3",
        QIIP_DEPLOYMENTS__REPLACE_AFTER_S="2",
        QIIP_DEPLOYMENTS__FAILURE_BACKOFF_S="1",
        QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS="3",
        QIIP_HEALTH__INTERVAL_S="0.3",
        QIIP_HEALTH__FAILURE_THRESHOLD="2",
        # A replica answers its probes late while new replicas load their models on the same cores under load (two
        # probes past 2 s once marked the only serving replica down, and its waiting requests failed): ten seconds
        # still tell a hung replica from a slow answer, and scaling is what this module tests.
        QIIP_HEALTH__TIMEOUT_S="10",
    )
    with Daemon(tmp_path_factory.mktemp("autoscale-state"), env=env) as daemon:
        yield Fleet(daemon, hosts, artifact)
    for _ in hosts_iter:
        pass


def autoscaled(fleet: Fleet, name: str, **policy: object) -> dict[str, Any]:
    return {
        "name": name,
        "source": {"artifact": fleet.artifact},
        "runtime": {"sizing": TINY_SIZING},
        "autoscale": {"up_window_s": 1.0, "down_window_s": 2.0, "cooldown_s": 1.0, **policy},
    }


def scaled(fleet: Fleet, name: str) -> list[str]:
    """The autoscaler's steps, as its events say them (`autoscaler: 1 → 3 replicas (…)` is `1 → 3`)."""
    events = status_of(fleet.daemon, name).get("events", [])
    steps = [e["message"] for e in events if e["kind"] == "scaled" and e["message"].startswith("autoscaler: ")]
    return [step.removeprefix("autoscaler: ").split(" replicas")[0] for step in steps]


@pytest.mark.timeout(900)  # provisions several replicas in turn
def test_load_scales_a_deployment_up_and_back_down_and_recommend_mode_only_says_so(fleet: Fleet) -> None:
    # One request in flight per slot is the target: six clients on one replica (one slot) are far above it, and one
    # client alone can never be above it, however slow a busy machine makes its answers.
    spec = autoscaled(fleet, "surge", min=1, max=3, metric="in_flight_per_slot", target=1.0, mode="recommend")
    spec["replicas"] = 1
    assert fleet.daemon.admin.put("/admin/deployments/surge", json=spec).status_code == 201
    wait_until(lambda: settled(fleet.daemon, "surge", 1), 300, "the first replica")
    with ClientLoop(fleet.daemon.url, "surge", threads=6, max_tokens=32) as load:
        # Recommend mode computes the count and changes nothing.
        wait_until(
            lambda: status_of(fleet.daemon, "surge")["autoscale"].get("recommendation") == 3, 120, "a recommendation"
        )
        status = status_of(fleet.daemon, "surge")
        assert status["desired"] == 1 and len(status["replicas"]) == 1 and not scaled(fleet, "surge")
        assert "above 1 " in status["autoscale"]["reason"], status["autoscale"]
        # /metrics follows the stored status within a reconcile interval.
        recommended = 'qiip_deployment_autoscale_recommendation{deployment="surge"} 3.0'
        wait_until(lambda: recommended in fleet.daemon.metrics(), 60, "the recommendation in /metrics")
        assert 'qiip_deployment_desired_replicas{deployment="surge"} 1.0' in fleet.daemon.metrics()
        # Active mode acts on the same measurement.
        view = deployment(fleet.daemon, "surge")
        spec["autoscale"]["mode"] = "active"
        changed = fleet.daemon.admin.put(
            "/admin/deployments/surge", params={"generation": view["generation"]}, json=spec
        )
        assert changed.status_code == 200, changed.text
        wait_until(lambda: settled(fleet.daemon, "surge", 3), 300, "three replicas under load")
        # Read under the load: once it ends, the autoscaler may step down before the lighter load below starts.
        ups = scaled(fleet, "surge")
    assert load.failed == 0, load.errors
    # Up to three in steps that only rise: one step of 1 → 3 when the window saw all six clients in flight, or more
    # when a busy machine kept some of them between requests for part of it.
    assert ups and ups[-1].endswith("→ 3") and all(int(a) < int(b) for a, b in (s.split(" → ") for s in ups)), ups
    # The load falls to one client resting between requests: one step down per cooldown, each replica drained
    # first, no request lost.
    with ClientLoop(fleet.daemon.url, "surge", pause_s=0.5) as light:
        wait_until(lambda: settled(fleet.daemon, "surge", 1), 300, "back to one replica")
    assert light.failed == 0, light.errors
    assert scaled(fleet, "surge") == [*ups, "3 → 2", "2 → 1"]
    assert 'qiip_deployment_replicas{deployment="surge",state="ready"} 1.0' in fleet.daemon.metrics()
    assert fleet.daemon.admin.delete("/admin/deployments/surge").status_code == 202
    wait_until(lambda: fleet.daemon.admin.get("/admin/deployments/surge").status_code == 404, 300, "surge removed")


@pytest.mark.timeout(900)  # provisions several replicas in turn
def test_fifty_first_requests_start_one_replica_of_a_deployment_at_zero_which_returns_to_zero(fleet: Fleet) -> None:
    spec = autoscaled(fleet, "lazy", min=0, max=2, metric="queued", target=1000.0, mode="active")
    spec["replicas"] = 0
    spec["autoscale"]["activation_timeout_s"] = 600.0
    assert fleet.daemon.admin.put("/admin/deployments/lazy", json=spec).status_code == 201
    wait_until(lambda: status_of(fleet.daemon, "lazy").get("observed_generation") == 1, 60, "the first pass")
    assert status_of(fleet.daemon, "lazy")["replicas"] == []

    def ask(_: int) -> tuple[int, str]:
        body = {"model": "lazy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with (
            httpx.Client(base_url=fleet.daemon.url, timeout=600, trust_env=False) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as answer,
        ):
            return answer.status_code, answer.read().decode()

    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(ask, range(50)))
    assert all(status == 200 and text.rstrip().endswith("data: [DONE]") for status, text in answers), answers[:3]
    placed = [e for e in status_of(fleet.daemon, "lazy")["events"] if e["kind"] == "placed"]
    assert len(placed) == 1, placed
    assert scaled(fleet, "lazy")[0] == "0 → 1", scaled(fleet, "lazy")
    # Idle past the down window: back to zero, the host released.
    wait_until(lambda: not status_of(fleet.daemon, "lazy")["replicas"], 300, "zero replicas again")
    assert scaled(fleet, "lazy") == ["0 → 1", "1 → 0"]


def test_a_deployment_at_zero_with_no_host_answers_503_with_retry_after_within_its_bound(fleet: Fleet) -> None:
    spec = autoscaled(fleet, "nowhere", min=0, max=1, mode="active")
    spec.update(replicas=0, placement={"labels": {"gpu": "h100"}})
    spec["autoscale"]["activation_timeout_s"] = 2.0
    assert fleet.daemon.admin.put("/admin/deployments/nowhere", json=spec).status_code == 201
    wait_until(lambda: status_of(fleet.daemon, "nowhere").get("observed_generation") == 1, 60, "the first pass")
    body = {"model": "nowhere", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    answer = fleet.daemon.client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "10", answer.text
    error = answer.json()["error"]
    assert error["code"] == "model_unavailable" and "no replica became ready within 2 s" in error["message"], error
    assert fleet.daemon.admin.delete("/admin/deployments/nowhere").status_code == 202

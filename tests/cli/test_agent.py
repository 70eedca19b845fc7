"""`qiip agent` end to end: the real pynvml over a stub NVML library, publishing into a real etcd or serving its
HTTP endpoint, and the real daemon showing the readings in `/admin/nodes` and `/metrics`."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.agent import Agent
from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.etcd import EtcdServer
from tests.support.nvml_stub import STUB_GPUS

pytestmark = pytest.mark.integration

INTERVAL = {"QIIP_TELEMETRY__INTERVAL_S": "0.2", "QIIP_LOGGING__LEVEL": "INFO"}
"""A reading every 0.2 s, expiring after three (the etcd lease: 2 s, etcd's shortest)."""


def etcd_env(etcd: EtcdServer) -> dict[str, str]:
    return {"QIIP_REGISTRY__BACKEND": "etcd", "QIIP_ETCD__ENDPOINTS": json.dumps([etcd.url])}


def gpus_live(daemon: Daemon, node_id: str) -> Any:
    response = daemon.admin.get(f"/admin/nodes/{node_id}")
    assert response.status_code == 200, response.text
    return response.json()["gpus_live"]


def register(daemon: Daemon, node_id: str) -> None:
    body = {"id": node_id, "endpoint": f"http://127.0.0.1:{free_port()}", "model": "m"}
    assert daemon.admin.post("/admin/nodes", json=body).status_code == 201
    wait_until(lambda: daemon.admin.get(f"/admin/nodes/{node_id}").status_code == 200, what=f"node {node_id}")


def gauge(metrics: Daemon | str, name: str, node: str, gpu: str) -> float | None:
    """The value of `name` for `node`'s GPU `gpu` in a `/metrics` scrape (a daemon: scrape it now), None if absent."""
    text = metrics.metrics() if isinstance(metrics, Daemon) else metrics
    match = re.search(rf'^{name}\{{gpu="{gpu}",node="{node}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def fresh_scrape(daemon: Daemon, node: str) -> str:
    """A `/metrics` scrape that holds `node`'s GPU reading. A reading is exported only while it is fresh (three
    agent intervals): on a busy machine one poll can lag past that, so wait for a scrape that has it."""
    scrapes: list[str] = []

    def has_reading() -> bool:
        scrapes.append(daemon.metrics())
        return f'qiip_gpu_reading_age_seconds{{node="{node}"}}' in scrapes[-1]

    wait_until(has_reading, what=f"a scrape with {node}'s fresh reading")
    return scrapes[-1]


def telemetry_keys(etcd: EtcdServer) -> list[dict[str, Any]]:
    return etcd.range_prefix(b"/telemetry/")


def test_the_agent_publishes_into_etcd_and_the_daemon_shows_it(etcd: EtcdServer, nvml_stub: Path, tmp_path: Path):
    with Daemon(tmp_path / "gateway", env=etcd_env(etcd) | INTERVAL) as daemon:
        register(daemon, "gpu-node-1")
        assert gpus_live(daemon, "gpu-node-1") is None
        env = etcd_env(etcd) | INTERVAL | {"LD_LIBRARY_PATH": str(nvml_stub)}
        with Agent(tmp_path / "agent", env=env, args=("--node-id", "gpu-node-1")) as agent:
            wait_until(lambda: gpus_live(daemon, "gpu-node-1") is not None, what="the first reading")
            live = gpus_live(daemon, "gpu-node-1")
            assert live["gpus"] == list(STUB_GPUS)
            assert live["driver_version"] == "580.126.09" and live["stale"] is False
            assert live["read_at"].endswith("Z") and live["age_s"] >= 0
            # The key lives under a lease, so a dead agent's reading expires by itself.
            [kv] = telemetry_keys(etcd)
            assert int(kv["lease"]) != 0
            scrape = fresh_scrape(daemon, "gpu-node-1")
            assert gauge(scrape, "qiip_gpu_memory_total_bytes", "gpu-node-1", "0") == 81920 * 1024 * 1024
            assert gauge(scrape, "qiip_gpu_memory_used_bytes", "gpu-node-1", "0") == 20480 * 1024 * 1024
            assert gauge(scrape, "qiip_gpu_utilization_ratio", "gpu-node-1", "0") == 0.37
            assert gauge(scrape, "qiip_gpu_temperature_celsius", "gpu-node-1", "1") == 31
            assert gauge(scrape, "qiip_gpu_power_watts", "gpu-node-1", "0") == 250.5
            assert gauge(scrape, "qiip_gpu_power_watts", "gpu-node-1", "1") is None  # not supported by that GPU
            promtool = shutil.which("promtool")
            if promtool is not None:  # the Debian package `prometheus` (scripts/setup --test)
                checked = subprocess.run(
                    [promtool, "check", "metrics"], input=daemon.metrics().encode(), capture_output=True, timeout=60
                )
                assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()
            # A clean stop revokes the lease: the reading goes at once, not a TTL later.
            assert agent.stop() == 0
        assert telemetry_keys(etcd) == []
        wait_until(lambda: gpus_live(daemon, "gpu-node-1") is None, what="the reading to go")
        assert gauge(daemon, "qiip_gpu_memory_total_bytes", "gpu-node-1", "0") is None
        assert agent.log().count("publishing 2 GPU(s) of node gpu-node-1") == 1


def test_a_killed_agent_s_reading_expires_with_its_lease(etcd: EtcdServer, nvml_stub: Path, tmp_path: Path):
    env = etcd_env(etcd) | INTERVAL | {"LD_LIBRARY_PATH": str(nvml_stub)}
    with Agent(tmp_path / "agent", env=env, args=("--node-id", "gpu-node-9")) as agent:
        wait_until(lambda: len(telemetry_keys(etcd)) == 1, what="the first reading")
        agent.stop(signal.SIGKILL)
    wait_until(lambda: telemetry_keys(etcd) == [], what="the lease to expire")


def test_the_agent_serves_http_and_the_embedded_daemon_polls_it(nvml_stub: Path, tmp_path: Path):
    token_file = tmp_path / "agent.token"
    token_file.write_text("s3cret-telemetry-token\n")
    token_file.chmod(0o600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent_env = INTERVAL | {
        "QIIP_TELEMETRY__LISTEN_PORT": str(port),
        "QIIP_TELEMETRY__TOKEN_FILE": str(token_file),
        "QIIP_TELEMETRY__NODE_ID": "gpu-node-2",
        "LD_LIBRARY_PATH": str(nvml_stub),
    }
    with Agent(tmp_path / "agent", env=agent_env) as agent, httpx.Client(base_url=url, trust_env=False) as client:

        def answers() -> bool:
            try:
                return client.get(
                    "/v1/telemetry", headers={"Authorization": "Bearer s3cret-telemetry-token"}
                ).is_success
            except httpx.TransportError:
                return False

        wait_until(answers, what="the agent's endpoint")
        refused = client.get("/v1/telemetry")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        assert refused.json()["error"]["code"] == "unauthorized"
        wrong = client.get("/v1/telemetry", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "refused" in wrong.json()["error"]["message"]
        assert "s3cret" not in agent.log()

        daemon_env = INTERVAL | {
            "QIIP_TELEMETRY__AGENTS": json.dumps([{"node": "gpu-node-2", "url": url}]),
            "QIIP_TELEMETRY__TOKEN_FILE": str(token_file),
        }
        with Daemon(tmp_path / "gateway", env=daemon_env) as daemon:
            register(daemon, "gpu-node-2")
            wait_until(lambda: gpus_live(daemon, "gpu-node-2") is not None, what="the first poll")
            assert gpus_live(daemon, "gpu-node-2")["gpus"] == list(STUB_GPUS)
            listed = daemon.admin.get("/admin/nodes").json()["nodes"]
            assert [n["gpus_live"]["gpus"][1]["name"] for n in listed] == ["NVIDIA Stub L4"]
            scrape = fresh_scrape(daemon, "gpu-node-2")
            assert gauge(scrape, "qiip_gpu_memory_total_bytes", "gpu-node-2", "1") == 23034 * 1024 * 1024
            assert agent.stop() == 0
            # The daemon keeps the last reading with its age; once stale, Prometheus no longer gets it.
            wait_until(lambda: gpus_live(daemon, "gpu-node-2")["stale"], what="the reading to go stale")
            assert gauge(daemon, "qiip_gpu_memory_total_bytes", "gpu-node-2", "1") is None
            assert "no reading from the agent of gpu-node-2" in daemon.log()


def test_the_agent_s_endpoint_holds_to_the_daemon_s_limits(tmp_path: Path):
    port = free_port()
    agent_env = {
        "QIIP_TELEMETRY__LISTEN_PORT": str(port),
        "QIIP_TELEMETRY__TOKEN": "s3cret-telemetry-token",
        "QIIP_ADMIN__AUTH_FAILURE_BURST": "3",
        "QIIP_SERVER__HEADER_TIMEOUT_S": "2",
        "QIIP_SERVER__MAX_CONNECTIONS_PER_ADDRESS": "4",
    }

    def answer_to(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
            sock.sendall(data)
            return read_all(sock)

    with Agent(tmp_path / "agent", env=agent_env) as agent, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        right = {"Authorization": "Bearer s3cret-telemetry-token"}

        def answers() -> bool:
            try:
                return client.get("/v1/telemetry", headers=right).status_code == 503  # no NVML here
            except httpx.TransportError:
                return False

        wait_until(answers, what="the agent's endpoint")
        # No token at all is refused without counting; wrong ones are logged and, past the burst, throttled.
        assert [client.get("/v1/telemetry").status_code for _ in range(6)] == [401] * 6
        wrong = {"Authorization": "Bearer nope"}
        assert [client.get("/v1/telemetry", headers=wrong).status_code for _ in range(4)] == [401, 401, 401, 429]
        throttled = client.get("/v1/telemetry", headers=right)
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
        assert agent.log().count("a wrong bearer token from 127.0.0.1") == 3 and "s3cret" not in agent.log()
        # Headers that never finish are answered 408 and closed.
        assert answer_to(b"GET /v1/telemetry HTTP/1.1\r\nHost: localhost\r\n").startswith(b"HTTP/1.1 408")
        # An address holding its 4 connections gets 503 on its next one.
        held = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(4)]
        try:
            assert answer_to(b"").startswith(b"HTTP/1.1 503")
        finally:
            for sock in held:
                sock.close()


def read_all(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_a_reading_is_judged_by_the_agent_s_own_interval_not_the_gateway_s(
    etcd: EtcdServer, nvml_stub: Path, tmp_path: Path
):
    # By the gateway's own interval (0.2 s) a reading would be stale 0.6 s after it came; the agent reads every 2 s.
    gateway_env = etcd_env(etcd) | INTERVAL
    agent_env = etcd_env(etcd) | {"QIIP_TELEMETRY__INTERVAL_S": "2", "LD_LIBRARY_PATH": str(nvml_stub)}
    with (
        Daemon(tmp_path / "gateway", env=gateway_env) as daemon,
        Agent(tmp_path / "agent", env=agent_env, args=("--node-id", "gpu-node-3")),
    ):
        register(daemon, "gpu-node-3")
        wait_until(lambda: gpus_live(daemon, "gpu-node-3") is not None, what="the first reading")
        first = gpus_live(daemon, "gpu-node-3")["read_at"]
        deadline = time.monotonic() + 30
        # From one reading to the next, the GPUs never vanish.
        while (live := gpus_live(daemon, "gpu-node-3"))["read_at"] == first:
            assert live["stale"] is False and live["interval_s"] == 2.0
            assert gauge(daemon, "qiip_gpu_memory_total_bytes", "gpu-node-3", "0") is not None
            assert time.monotonic() < deadline, "no second reading"


def test_without_nvml_the_agent_says_so_once_and_publishes_nothing(etcd: EtcdServer, tmp_path: Path):
    with Agent(tmp_path / "agent", env=etcd_env(etcd) | INTERVAL, args=("--node-id", "cpu-node")) as agent:
        wait_until(lambda: "NVML cannot be used" in agent.log(), what="the agent to report no NVML")
        time.sleep(1.0)  # several more intervals, each trying NVML again
        assert agent.process is not None and agent.process.poll() is None  # it keeps running
        assert telemetry_keys(etcd) == []
        assert agent.stop() == 0
    assert agent.log().count("NVML cannot be used") == 1, agent.log()


def test_the_http_agent_needs_a_token_and_a_free_port(tmp_path: Path):
    refused = run_qiip(tmp_path, "agent")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: The agent's HTTP endpoint needs a bearer token: set telemetry.token_file (or telemetry.token)."
    )
    taken = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        busy = run_qiip(
            tmp_path, "agent", env={"QIIP_TELEMETRY__TOKEN": "t", "QIIP_TELEMETRY__LISTEN_PORT": str(taken)}
        )
    assert busy.returncode == 1
    assert busy.stderr.strip().splitlines()[-1].startswith(f"error: The agent cannot listen on 127.0.0.1:{taken} (")


def test_a_node_id_that_no_node_can_have_is_refused(tmp_path: Path):
    refused = run_qiip(tmp_path, "agent", "--node-id", "gpu/01")
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "error: the node id 'gpu/01' is not one a node can have: up to 128 letters, digits, '.', '_', ':' and '-', "
        "starting with a letter or digit; give --node-id."
    )

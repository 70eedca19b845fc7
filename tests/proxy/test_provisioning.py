"""Provisioning through the daemon: the admin API's setup, teardown, tasks and logs, against loopback SSH hosts.

The end-to-end test sets a host up with the llama.cpp engine in the CPU test profile (the project's own built
llama-server, planned and verified as local nodes are), sends a chat completion through the gateway with the
`openai` client, and tears the node down again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qiip_core.catalog import scan_catalog
from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.hf_cache import HfCacheBuilder
from tests.support.sshd import SshHosts, alive

pytestmark = pytest.mark.integration

TINY_SIZING = {"sizing": "custom", "context_per_slot": 512, "slots": 1, "cache_type": "f16", "fit_target_mib": 64}


@pytest.fixture(scope="module")
def cpu_hosts(
    tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path
) -> Iterator[SshHosts]:
    """Four Debian hosts without GPUs (127.0.0.20–23) with the project's CPU llama-server installed."""
    models = tmp_path_factory.mktemp("shared-models")
    shutil.copy(tiny_gguf, models / "tiny.gguf")
    # The same model as a generation of a Hugging Face cache, for setups by artifact_id.
    HfCacheBuilder(models).add_file(TINY_REPO, "a" * 40, "tiny-Q8_0.gguf", source=tiny_gguf)
    with SshHosts(tmp_path_factory.mktemp("cpu-ssh"), 4, family="debian", gpu=False, first=20) as hosts:
        for host in hosts.hosts:
            host.preinstall_llamacpp(llama_server_binary)
            host.share_models(models)
        hosts.models = models  # type: ignore[attr-defined]
        yield hosts
        for host in hosts.hosts:
            pid = host.engine_pid("llamacpp")
            if pid is not None and alive(pid):
                os.killpg(pid, signal.SIGKILL)


def daemon_env(hosts: SshHosts, engine_port: int, **extra: str) -> dict[str, str]:
    return {
        "QIIP_PROVISIONING__PROFILE": "cpu",
        "QIIP_PROVISIONING__SSH_PORT": str(hosts.port),
        "QIIP_PROVISIONING__SSH_KEY_FILE": str(hosts.client_key),
        "QIIP_PROVISIONING__KNOWN_HOSTS_FILE": str(hosts.known_hosts),
        "QIIP_PROVISIONING__ENGINE_PORT": str(engine_port),
        "QIIP_PROVISIONING__MODEL_CACHE_DIR": str(hosts.models),  # type: ignore[attr-defined]
        "QIIP_PROVISIONING__HEALTH_INTERVAL_S": "0.2",
        "QIIP_PROVISIONING__HEALTH_TIMEOUT_S": "60",
        "QIIP_PROVISIONING__MIN_FREE_DISK_GIB": "0.01",
        "QIIP_PROVISIONING__SSH_WAIT_TIMEOUT_S": "1",
        "QIIP_PROVISIONING__MAX_CONCURRENT_SETUPS": "2",
        **extra,
    }


TINY_REPO = "qiip-test/tiny-remote-GGUF"


def setup_body(host: str, **extra: Any) -> dict[str, Any]:
    return {"hostname": host, "engine": "llama_cpp", "model": "tiny.gguf", "alias": "tiny-remote", **extra}


def wait_operation(daemon: Daemon, operation_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def done() -> bool:
        result.update(daemon.admin.get(f"/admin/operations/{operation_id}").json())
        return bool(result["state"] != "running")

    wait_until(done, timeout_s, f"operation {operation_id}")
    return result


def task_of(daemon: Daemon, host: str) -> dict[str, Any]:
    """The host's task record; empty until the daemon has written it (a 202 may come first)."""
    tasks = daemon.admin.get("/admin/provisioning/tasks").json()["tasks"]
    return next((t for t in tasks if t["hostname"] == host), {})


def hang(hosts: SshHosts, index: int, on: bool) -> None:
    flag = hosts[index].root / "etc" / "package-manager-hangs"
    if on:
        flag.touch()
    else:
        flag.unlink(missing_ok=True)


def test_setup_serves_through_the_gateway_then_teardown_removes_it(cpu_hosts: SshHosts, tmp_path: Path) -> None:
    host = cpu_hosts[0]
    engine_port = free_port()
    with Daemon(tmp_path / "state", env=daemon_env(cpu_hosts, engine_port)) as daemon:
        # Served by its catalog id: the generation's path in the shared cache, the same on the host.
        artifact = next(g.artifact_id for g in scan_catalog(cpu_hosts.models).gguf if g.repo_id == TINY_REPO)  # type: ignore[attr-defined]
        body = setup_body(host.address, sizing=TINY_SIZING, artifact_id=artifact)
        del body["model"]
        answer = daemon.admin.post("/admin/nodes/setup", json=body)
        assert answer.status_code == 202, answer.text
        operation = wait_operation(daemon, answer.json()["task_id"])
        assert operation["state"] == "succeeded", (operation["error"], daemon.log()[-3000:])
        node = operation["result"]["node"]
        assert node["managed"] and node["engine"] == "llama_cpp" and node["artifact_id"] == artifact
        assert node["llamacpp_runtime"]["effective"]["slots"] == 1
        assert node["llamacpp_runtime"]["effective"]["context_per_slot"] == 512
        daemon.wait_status(host.address, "healthy", timeout_s=30)
        assert task_of(daemon, host.address)["current_step"] == "complete"

        with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
            completion = client.chat.completions.create(
                model="tiny-remote", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert completion.choices[0].message.content is not None
        assert completion.model == "tiny-remote"

        with daemon.admin.stream("GET", f"/admin/provisioning/{host.address}/logs", params={"follow": "false"}) as sse:
            entries = [json.loads(line[6:]) for line in sse.iter_lines() if line.startswith("data: ")]
        assert {"ts", "level", "msg", "stream", "step"} <= set(entries[0])
        steps = {e["step"] for e in entries}
        assert {"preflight", "uploading", "llamacpp_install", "health_poll", "verifying", "registering"} <= steps
        assert "llamacpp_install done: llama.cpp 0.3.36 (cpu) already installed" in [e["msg"] for e in entries]
        assert any(e["stream"] == "stdout" and e["step"] == "system_update" for e in entries)  # apt-get's output

        engine_pid = host.engine_pid("llamacpp")
        assert engine_pid is not None and alive(engine_pid)
        teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
        assert teardown.status_code == 202, teardown.text
        assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
        daemon.wait_gone(host.address)
        wait_until(lambda: not alive(engine_pid), 20, "llama-server to stop")
        assert task_of(daemon, host.address)["current_step"] == "teardown_complete"
        # The host's lease is free again: a new setup is accepted.
        hang(cpu_hosts, 0, True)
        try:
            again = daemon.admin.post("/admin/nodes/setup", json=setup_body(host.address))
            assert again.status_code == 202, again.text
            assert daemon.admin.post(f"/admin/provisioning/{host.address}/cancel", json={}).status_code == 202
            assert wait_operation(daemon, again.json()["id"])["state"] == "cancelled"
        finally:
            hang(cpu_hosts, 0, False)


def test_refusals_come_before_any_remote_work(cpu_hosts: SshHosts, tmp_path: Path) -> None:
    with Daemon(tmp_path / "state", env=daemon_env(cpu_hosts, free_port())) as daemon:
        outside = daemon.admin.post("/admin/nodes/setup", json=setup_body("10.1.2.3"))
        assert outside.status_code == 400 and outside.json()["error"]["code"] == "host_not_allowed"
        artifact = "0" * 64
        for bad in (
            {"hostname": "127.0.0.21", "engine": "tgi", "model": "m"},
            {"hostname": "127.0.0.21"},
            {"x": 1},
            {"hostname": "127.0.0.21", "engine": "llama_cpp"},
            {"hostname": "127.0.0.21", "engine": "llama_cpp", "model": "m", "artifact_id": artifact},
            {"hostname": "127.0.0.21", "engine": "vllm", "artifact_id": artifact},
        ):
            refused = daemon.admin.post("/admin/nodes/setup", json=bad)
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_setup", refused.text
        unknown = daemon.admin.post(
            "/admin/nodes/setup", json={"hostname": "127.0.0.21", "engine": "llama_cpp", "artifact_id": artifact}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "artifact_not_found", unknown.text
        assert daemon.admin.get("/admin/provisioning/tasks").json()["tasks"] == []

        hang(cpu_hosts, 1, True)
        hang(cpu_hosts, 2, True)
        try:
            first = daemon.admin.post("/admin/nodes/setup", json=setup_body("127.0.0.21"))
            assert first.status_code == 202
            busy = daemon.admin.post("/admin/nodes/setup", json=setup_body("127.0.0.21"))
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "host_busy"
            second = daemon.admin.post("/admin/nodes/setup", json=setup_body("127.0.0.22"))
            assert second.status_code == 202
            over = daemon.admin.post("/admin/nodes/setup", json=setup_body("127.0.0.23"))
            assert over.status_code == 429 and over.json()["error"]["code"] == "too_many_setups"
            for answer in (first, second):
                host: str = answer.json()["node_id"]
                wait_until(lambda: task_of(daemon, host).get("current_step") == "system_update", 30, "the hang")  # noqa: B023
                daemon.admin.post(f"/admin/provisioning/{host}/cancel", json={})
                assert wait_operation(daemon, answer.json()["id"])["state"] == "cancelled"
        finally:
            hang(cpu_hosts, 1, False)
            hang(cpu_hosts, 2, False)


def test_a_gateway_killed_mid_setup_marks_the_task_failed_at_its_next_start(
    cpu_hosts: SshHosts, tmp_path: Path
) -> None:
    hang(cpu_hosts, 3, True)
    host = cpu_hosts[3].address
    try:
        daemon = Daemon(tmp_path / "state", env=daemon_env(cpu_hosts, free_port())).start()
        try:
            assert daemon.admin.post("/admin/nodes/setup", json=setup_body(host)).status_code == 202
            wait_until(lambda: task_of(daemon, host).get("current_step") == "system_update", 30, "the hang")
            daemon.stop(signal.SIGKILL)
            assert task_of_file(tmp_path / "state", host)["state"] == "running"
            daemon.start()
            task = task_of(daemon, host)
            assert (task["state"], task["failed_step"]) == ("failed", "system_update")
            assert "stopped during step system_update" in task["error"]
            statuses = daemon.node_statuses()
            assert statuses.get(host) == "failed"
        finally:
            daemon.close()
    finally:
        hang(cpu_hosts, 3, False)


def task_of_file(state_dir: Path, host: str) -> dict[str, Any]:
    tasks = json.loads((state_dir / "provisioning.json").read_text())["tasks"]
    return next(t for t in tasks if t["hostname"] == host)


def test_qiip_node_setup_follows_the_log_a_line_per_step(cpu_hosts: SshHosts, tmp_path: Path) -> None:
    host, engine_port = cpu_hosts[1].address, free_port()
    with Daemon(tmp_path / "state", env=daemon_env(cpu_hosts, engine_port)) as daemon:
        env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
        argv = ["node", "setup", host, "--engine", "llama_cpp", "--model", "tiny.gguf", "--alias", "tiny-cli"]
        cli_dir = tmp_path / "cli"
        cli_dir.mkdir()
        done = run_qiip(cli_dir, *argv, "--sizing", json.dumps(TINY_SIZING), env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"setting up {host} (llama_cpp, tiny.gguf): operation op_")
        steps = [line.split("] ", 1)[1] for line in lines[1:-1] if "]   " not in line]
        for step in ("preflight", "uploading", "system_update", "llamacpp_install", "health_poll", "registering"):
            assert step in steps, lines
        assert lines[-1] == f"{host} is a node: http://{host}:{engine_port} serving 'tiny-cli'"
        teardown = daemon.admin.delete(f"/admin/nodes/{host}")
        assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"

        refused = run_qiip(cli_dir, "node", "setup", "10.1.2.3", "--engine", "vllm", "--model", "m", env=env)
        assert refused.returncode == 1
        assert refused.stderr.startswith("error: Host 10.1.2.3 cannot be provisioned:"), refused.stderr

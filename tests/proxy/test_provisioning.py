"""Provisioning through the daemon: the admin API's setup, teardown, tasks and logs, against loopback SSH hosts.

The end-to-end test sets a host up with the llama.cpp engine in the CPU test profile (the project's own built
llama-server, planned and verified as local nodes are), sends a chat completion through the gateway with the
`openai` client, and tears the node down again.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from qiip_core.catalog import scan_catalog
from tests.support.cli import run_qiip
from tests.support.daemon import Daemon, free_port, wait_until
from tests.support.provisioning import (
    TINY_REPO,
    TINY_SIZING,
    cpu_hosts as provisioned_cpu_hosts,
    daemon_env,
    hang,
    setup_body,
    task_of,
    wait_operation,
)
from tests.support.sshd import SshHosts, alive

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cpu_hosts(
    tmp_path_factory: pytest.TempPathFactory, llama_server_binary: Path, tiny_gguf: Path
) -> Iterator[SshHosts]:
    """Four Debian hosts without GPUs (127.0.0.20–23) with the project's CPU llama-server installed."""
    yield from provisioned_cpu_hosts(
        tmp_path_factory.mktemp("cpu-ssh"),
        tmp_path_factory.mktemp("shared-models"),
        llama_server_binary,
        tiny_gguf,
        count=4,
        first=20,
        holdable=False,
    )


SECRET_INDEX = "https://ops:s3cret-index@pypi.example/simple"
"""A package index URL with credentials, as a site mirror has them."""


def test_setup_serves_through_the_gateway_then_teardown_removes_it(cpu_hosts: SshHosts, tmp_path: Path) -> None:
    host = cpu_hosts[0]
    engine_port = free_port()
    # Logged at DEBUG, where every remote command is: its environment's values never are.
    env = daemon_env(cpu_hosts, engine_port, QIIP_PROVISIONING__PIP_INDEX_URL=SECRET_INDEX, QIIP_LOGGING__LEVEL="DEBUG")
    with Daemon(tmp_path / "state", env=env) as daemon:
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
        # No secret in the daemon's log, the host's log or the engine's environment; the commands are logged.
        assert "s3cret-index" not in daemon.log() and "QIIPNODE_PIP_INDEX=[redacted]" in daemon.log()
        assert not any("s3cret-index" in e["msg"] for e in entries)
        assert b"QIIPNODE_" not in Path(f"/proc/{engine_pid}/environ").read_bytes()
        teardown = daemon.admin.delete(f"/admin/nodes/{host.address}")
        assert teardown.status_code == 202, teardown.text
        assert wait_operation(daemon, teardown.json()["id"])["state"] == "succeeded"
        daemon.wait_gone(host.address)
        wait_until(lambda: not alive(engine_pid), what="llama-server to stop")
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
            if bad.get("engine") == "tgi":
                assert refused.json()["error"]["message"] == (
                    "Not a setup request: engine: Input should be 'llama_cpp', 'vllm' or 'ollama'."
                )
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


def test_a_setup_wrong_in_any_field_is_refused_before_any_ssh_connection(cpu_hosts: SshHosts, tmp_path: Path) -> None:
    host = cpu_hosts[2].address
    cases: list[tuple[dict[str, Any], str, str]] = [
        (setup_body(host, model="absent.gguf"), "model", "is not a file in the shared model cache"),
        (setup_body(host, model="../../etc/passwd"), "model", "each part is letters, digits"),
        (setup_body(host, model="/srv/hf-cache/tiny.gguf"), "model", "relative to it"),
        (setup_body(host, sizing={**TINY_SIZING, "slots": 0}), "sizing.slots", "slots must be between 1 and 256"),
        (setup_body(host, sizing={**TINY_SIZING, "slots": "x"}), "sizing.slots", "a whole number of slots"),
        (setup_body(host, alias="tiny\nforged line"), "alias", "no newline or control character"),
        (setup_body(host, alias="--api-key"), "alias", "starts with '-'"),
        ({"hostname": host, "engine": "vllm", "model": "--trust-remote-code"}, "model", "starts with '-'"),
        ({"hostname": host, "engine": "vllm", "model": "org/../x"}, "model", "not a Hugging Face repository id"),
        ({"hostname": host, "engine": "vllm", "model": "/etc/passwd"}, "model", "inside the hosts' model cache"),
        ({"hostname": host, "engine": "vllm", "model": "org/m", "sizing": TINY_SIZING}, "sizing", "vLLM sizes"),
    ]
    with Daemon(tmp_path / "state", env=daemon_env(cpu_hosts, free_port())) as daemon:
        before = cpu_hosts.connections(host)
        for body, field, reason in cases:
            refused = daemon.admin.post("/admin/nodes/setup", json=body)
            error = refused.json()["error"]
            assert (refused.status_code, error["code"], error["param"]) == (400, "invalid_setup", field), refused.text
            assert reason in error["message"], error["message"]
            assert "\n" not in error["message"]
        # Nothing was registered, recorded or contacted: not even a TCP connection reached the host's sshd.
        assert cpu_hosts.connections(host) == before
        assert daemon.admin.get("/admin/provisioning/tasks").json()["tasks"] == []
        assert host not in daemon.node_statuses()
        # A host with no task has no log, and asking for one keeps nothing.
        missing = daemon.admin.get("/admin/provisioning/no-such-host/logs", params={"follow": "false"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "host_not_found"


def test_qiip_node_forget_key_removes_a_reinstalled_hosts_entry_and_logs_it(
    cpu_hosts: SshHosts, tmp_path: Path
) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(cpu_hosts.known_hosts.read_text())
    entries = len(known.read_text().splitlines())
    env = daemon_env(cpu_hosts, free_port(), QIIP_PROVISIONING__KNOWN_HOSTS_FILE=str(known))
    with Daemon(tmp_path / "state", env=env) as daemon:
        cli_env = {"QIIP_URL": daemon.url, "QIIP_ADMIN__USERNAME": "admin", "QIIP_ADMIN__PASSWORD": "test-password"}
        (tmp_path / "cli").mkdir()
        done = run_qiip(tmp_path / "cli", "node", "forget-key", "127.0.0.23", env=cli_env)
        assert (done.returncode, done.stdout) == (0, "127.0.0.23: removed 1 known-hosts entry\n"), done.stderr
        assert f"[127.0.0.23]:{cpu_hosts.port} " not in known.read_text()
        assert len(known.read_text().splitlines()) == entries - 1
        assert "host key of 127.0.0.23 forgotten: 1 entry removed from" in daemon.log()
        again = run_qiip(tmp_path / "cli", "node", "forget-key", "127.0.0.23", env=cli_env)
        assert again.stdout == "127.0.0.23: no known-hosts entry to remove\n"
        outside = daemon.admin.delete("/admin/nodes/10.1.2.3/host-key")
        assert outside.status_code == 400 and outside.json()["error"]["code"] == "host_not_allowed"

"""The embedded registry from the outside: `qiip node …` against a running daemon, restarts, config files."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.cli import clean_environ, run_qiip
from tests.support.daemon import WAIT_S, Daemon, wait_until
from tests.support.fault_backend import FaultBackend, Gated, Json
from tests.support.zygote import run_to_end

pytestmark = pytest.mark.integration

Backends = Callable[..., FaultBackend]


def test_cli_changes_a_running_daemon_and_survive_a_restart(tmp_path: Path, backends: Backends) -> None:
    backend = backends()
    with Daemon(tmp_path) as daemon:
        added = run_qiip(tmp_path, "node", "add", "gpu01", f"127.0.0.1:{backend.port}", "--model", "org/m:q4")
        assert added.returncode == 0, added.stderr
        assert f"registered gpu01 at http://127.0.0.1:{backend.port}" in added.stdout
        daemon.wait_status("gpu01", "healthy")
        body = {"model": "org/m:q4", "messages": []}
        assert httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        listed = json.loads(run_qiip(tmp_path, "node", "list", "--json").stdout)
        assert [(n["id"], n["source"]) for n in listed] == [("gpu01", "state")]
    # The held request must outlast the `qiip node remove` subprocess, which can take seconds on a busy machine.
    patient = {"QIIP_UPSTREAM__TTFB_TIMEOUT_S": "120", "QIIP_UPSTREAM__GENERATION_TIMEOUT_S": "120"}
    with Daemon(tmp_path, env=patient) as daemon:
        daemon.wait_status("gpu01", "healthy")
        # Removing a node with a request in flight drains it: nothing new is sent, the old request finishes.
        release = threading.Event()
        backend.push(Gated(release, Json(200, {"finished": True})))
        answers: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: answers.append(httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=30))
        )
        thread.start()
        wait_until(lambda: daemon.in_flight("gpu01") == 1, what="the request to be in flight")
        removed = run_qiip(tmp_path, "node", "remove", "gpu01")
        assert removed.returncode == 0, removed.stderr
        daemon.wait_status("gpu01", "draining")
        fresh = httpx.post(daemon.url + "/v1/chat/completions", json=body, timeout=30)
        assert fresh.status_code == 503 and fresh.json()["error"]["code"] == "model_unavailable"
        release.set()
        thread.join(30)
        assert answers[0].status_code == 200 and answers[0].json() == {"finished": True}
        daemon.wait_gone("gpu01")


def test_cli_refusals_are_one_clear_line(tmp_path: Path) -> None:
    outside = run_qiip(tmp_path, "node", "add", "x", "http://10.1.2.3:8000", "--model", "m")
    assert outside.returncode == 1 and outside.stderr.startswith("error: The endpoint http://10.1.2.3:8000")
    no_port = run_qiip(tmp_path, "node", "add", "x", "http://127.0.0.1", "--model", "m")
    assert no_port.returncode == 1 and "has no port" in no_port.stderr
    missing = run_qiip(tmp_path, "node", "remove", "ghost")
    assert missing.returncode == 1 and "No node is registered with id 'ghost'" in missing.stderr
    bad_id = run_qiip(tmp_path, "node", "add", "bad id", "http://127.0.0.1:1", "--model", "m")
    assert bad_id.returncode == 1 and "NODE_ID must be 1-128 characters" in bad_id.stderr
    assert not (tmp_path / "nodes.json").exists()


def test_config_file_nodes_are_served(tmp_path: Path, backends: Backends) -> None:
    backend = backends()
    config = tmp_path / "qiip.toml"
    config.write_text(
        f"""
[routing]
max_attempts = 2

[[nodes]]
id = "cfg-node"
endpoint = "{backend.url}"
model = "cfg/model"
engine = "llama_cpp"
"""
    )
    with Daemon(tmp_path, config=config) as daemon:
        daemon.wait_status("cfg-node", "healthy")
        models = httpx.get(daemon.url + "/v1/models", timeout=30).json()["data"]
        assert models == [{"id": "cfg/model", "object": "model", "created": 0, "owned_by": "llama_cpp"}]
        removed = run_qiip(tmp_path, "--config", str(config), "node", "remove", "cfg-node")
        assert removed.returncode == 1 and "declared in the config file" in removed.stderr


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"QIIP_ROUTING__MAX_ATTEMPTS": "0"}, "routing.max_attempts (QIIP_ROUTING__MAX_ATTEMPTS)"),
        ({"QIIP_NODES": '[{"id": "a", "endpoint": "http://10.0.0.1:80", "model": "m"}]'}, "nodes.0.endpoint"),
        ({"QIIP_HEALTH__INTERVAL_S": "soon"}, "health.interval_s"),
        ({"QIIP_ADMIN__ENABLED": "true"}, "The admin API is enabled but has no credentials"),
        ({"QIIP_LOCAL_NODE_PLAN": "[" * 1500}, "QIIP_LOCAL_NODE_PLAN (the local nodes `qiip up` hands the daemon)"),
    ],
)
def test_invalid_settings_stop_start_up(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    result = run_to_end(
        "qiip_proxy",
        ["--port", "1"],
        clean_environ() | {"QIIP_STATE_DIR": str(tmp_path), "QIIP_ADMIN__ENABLED": "false"} | env,
        tmp_path,
        timeout_s=2 * WAIT_S,
    )
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr

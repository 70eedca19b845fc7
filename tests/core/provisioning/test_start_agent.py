"""`bundle/start-agent.sh` on a host root in a temporary directory: it writes the agent's settings and starts
`qiip agent` (no systemd under an install root), which publishes the stub GPUs into a real etcd as the host."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from qiip_core.config import load_settings
from qiip_core.nodes import Engine
from qiip_core.provisioning import bundle_files, bundle_parameters
from qiip_core.storage import unb64
from tests.support.cli import clean_environ
from tests.support.daemon import WAIT_S, free_port, wait_until
from tests.support.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_the_bundle_starts_the_agent_which_publishes_as_the_host(
    etcd: EtcdServer, nvml_stub: Path, tmp_path: Path
) -> None:
    settings = load_settings(
        registry={"backend": "etcd"},
        etcd={"endpoints": ["http://127.0.0.1:1"]},
        telemetry={"interval_s": 0.2},
        provisioning={
            "profile": "cpu",
            "telemetry_agent": True,
            "agent_package": "qiip==0.1.0",
            "agent_etcd_endpoints": [etcd.url],
        },
    )
    env = bundle_parameters(settings, Engine.VLLM, model_alias="m").env
    assert env["QIIPNODE_AGENT_PACKAGE"] == "qiip==0.1.0"
    root = tmp_path / "host"
    # QIIP already installed at that requirement (the venv a previous run made): this checkout's `qiip`.
    venv = root / "opt" / "qiip-agent"
    (venv / "bin").mkdir(parents=True)
    (venv / ".qiip-agent-package").write_text("qiip==0.1.0")
    qiip = venv / "bin" / "qiip"
    qiip.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "from qiip_cli import main; main()" "$@"\n')
    qiip.chmod(0o755)
    script = next(path for path in bundle_files() if path.name == "start-agent.sh")
    run_env = (
        clean_environ()
        | env
        | {
            "QIIPNODE_ROOT": str(root),
            "QIIPNODE_AGENT_NODE_ID": "gpu-host-7",
            "LD_LIBRARY_PATH": str(nvml_stub),
            "PYTHONPATH": str(Path(__file__).parents[3]),
        }
    )
    done = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "[STEP:telemetry_agent:START]"
    assert lines[-1].startswith("[STEP:telemetry_agent:OK] qiip agent running as node gpu-host-7 (PID ")
    env_file = root / "etc" / "qiip" / "agent.env"
    assert env_file.stat().st_mode & 0o077 == 0
    assert f"QIIP_ETCD__ENDPOINTS='{json.dumps([etcd.url])}'" in env_file.read_text().splitlines()
    pid = int((root / "var" / "run" / "qiip-agent.pid").read_text())
    try:
        wait_until(lambda: len(etcd.range_prefix(b"/telemetry/")) == 1, WAIT_S, "the agent's first reading")
        [kv] = etcd.range_prefix(b"/telemetry/")
        assert json.loads(unb64(kv["value"]))["node_id"] == "gpu-host-7"
    finally:
        os.killpg(pid, signal.SIGTERM)
    wait_until(lambda: etcd.range_prefix(b"/telemetry/") == [], 30, "the agent to withdraw its reading")
    log = (root / "var" / "log" / "qiip-agent.log").read_text()
    assert "publishing 2 GPU(s) of node gpu-host-7" in log


def test_with_the_embedded_registry_the_uploaded_token_guards_the_endpoint(nvml_stub: Path, tmp_path: Path) -> None:
    settings = load_settings(telemetry={"listen_port": 9555}, provisioning={"profile": "cpu", "telemetry_agent": True})
    lines = bundle_parameters(settings, Engine.VLLM, model_alias="m").env["QIIPNODE_AGENT_SETTINGS"].splitlines()
    assert "QIIP_TELEMETRY__LISTEN_HOST=0.0.0.0" in lines and "QIIP_TELEMETRY__LISTEN_PORT=9555" in lines
    assert "QIIP_TELEMETRY__TOKEN_FILE=/etc/qiip/agent.token" in lines
    root, bundle = tmp_path / "host", tmp_path / "bundle"
    bundle.mkdir()
    for path in bundle_files():
        shutil.copy2(path, bundle / path.name)
    token = bundle / "agent.token"
    token.touch(mode=0o600)
    token.write_text("uploaded-token\n")
    venv = root / "opt" / "qiip-agent"
    (venv / "bin").mkdir(parents=True)
    (venv / ".qiip-agent-package").write_text("qiip")
    qiip = venv / "bin" / "qiip"
    qiip.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "from qiip_cli import main; main()" "$@"\n')
    qiip.chmod(0o755)
    port = free_port()
    # The host's settings as `agent_settings` writes them, but on loopback and under the test's install root.
    agent_settings = "\n".join(
        [
            "QIIP_REGISTRY__BACKEND=embedded",
            "QIIP_TELEMETRY__INTERVAL_S=0.2",
            "QIIP_TELEMETRY__LISTEN_HOST=127.0.0.1",
            f"QIIP_TELEMETRY__LISTEN_PORT={port}",
            f"QIIP_TELEMETRY__TOKEN_FILE={root}/etc/qiip/agent.token",
        ]
    )
    run_env = clean_environ() | {
        "QIIPNODE_ROOT": str(root),
        "QIIPNODE_AGENT_PACKAGE": "qiip",
        "QIIPNODE_AGENT_NODE_ID": "gpu-host-8",
        "QIIPNODE_AGENT_SETTINGS": agent_settings,
        "LD_LIBRARY_PATH": str(nvml_stub),
        "PYTHONPATH": str(Path(__file__).parents[3]),
    }
    done = subprocess.run(
        ["bash", str(bundle / "start-agent.sh")], env=run_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[STEP:telemetry_agent:OK]" in done.stdout, done.stdout
    installed = root / "etc" / "qiip" / "agent.token"
    assert not token.exists() and installed.stat().st_mode & 0o777 == 0o600
    pid = int((root / "var" / "run" / "qiip-agent.pid").read_text())
    url = f"http://127.0.0.1:{port}/v1/telemetry"
    try:
        with httpx.Client(trust_env=False) as client:

            def served() -> bool:
                try:
                    return client.get(url, headers={"Authorization": "Bearer uploaded-token"}).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(served, WAIT_S, "the agent's endpoint")
            assert client.get(url).status_code == 401
            reading = client.get(url, headers={"Authorization": "Bearer uploaded-token"}).json()
            assert reading["node_id"] == "gpu-host-8" and len(reading["gpus"]) == 2
    finally:
        os.killpg(pid, signal.SIGTERM)

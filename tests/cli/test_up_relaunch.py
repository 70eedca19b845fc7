"""A local node's relaunched sizing survives a restart of `qiip up`, until its configuration changes."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiip_core.engines.llamacpp import RELAUNCHED_SIZING_FILE
from tests.cli.test_up import _up_env
from tests.support.cli import QIIP
from tests.support.daemon import free_port

pytestmark = pytest.mark.integration

CUSTOM = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 1024, "slots": 3, "cache_type": "f16"}


class _Up:
    """A `qiip up` run; `log` is what it (and its daemon) wrote to stderr, once it stopped."""

    log = ""


@contextlib.contextmanager
def _up(port: int, *args: str, env: dict[str, str], cwd: Path) -> Iterator[_Up]:
    """`qiip up --port PORT ARGS` once it serves; stopped with Ctrl-C (SIGINT) on the way out, its stderr kept."""
    run = _Up()
    with subprocess.Popen(
        [*QIIP, "up", "--port", str(port), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        try:
            assert up.stdout is not None and up.stderr is not None
            line = up.stdout.readline()
            assert line == f"OpenAI base URL: http://127.0.0.1:{port}/v1\n", line or up.stderr.read()
            yield run
        finally:
            up.send_signal(signal.SIGINT)
            _, run.log = up.communicate(timeout=60)
    assert up.returncode == 0, run.log


def _runtime(base: str, auth: tuple[str, str]) -> dict[str, Any]:
    runtime = httpx.get(f"{base}/admin/nodes/local", auth=auth).json()["llamacpp_runtime"]
    assert isinstance(runtime, dict)
    return runtime


def _relaunch(base: str, auth: tuple[str, str], policy: dict[str, Any]) -> None:
    started = httpx.post(f"{base}/admin/nodes/local/llamacpp/relaunch", json=policy, auth=auth, timeout=30)
    assert started.status_code == 202, started.text
    deadline, state = time.monotonic() + 120, ""
    while time.monotonic() < deadline:
        state = httpx.get(f"{base}/admin/operations/{started.json()['id']}", auth=auth).json()["state"]
        if state in ("succeeded", "failed"):
            break
        time.sleep(0.2)
    assert state == "succeeded"


def _plan_line(log: str) -> str:
    """The line `qiip up` printed for its model before starting it."""
    lines = [line for line in log.splitlines() if line.startswith("qiip-test-tiny: ")]
    assert len(lines) == 1, log
    return lines[0]


def test_a_relaunched_sizing_survives_a_restart_until_the_configuration_changes(
    tmp_path: Path, llama_server_binary: Path
) -> None:
    env = _up_env(tmp_path, llama_server_binary)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    record = tmp_path / "state" / RELAUNCHED_SIZING_FILE

    with _up(port, env=env, cwd=tmp_path) as up:
        console = tomllib.loads((tmp_path / "state" / "console.toml").read_text())
        auth = (console["username"], console["password"])
        configured = _runtime(base, auth)["requested"]
        assert configured["sizing"] == "custom" and configured["slots"] == 2
        _relaunch(base, auth, CUSTOM)
        assert _runtime(base, auth)["effective"]["slots"] == 3
    assert "local node local: relaunch sizing recorded" in up.log and record.exists()
    assert _plan_line(up.log).endswith(" MiB planned")
    recorded_on = json.loads(record.read_text())["local"]["relaunched_at"].partition("T")[0]

    # The same `qiip up` again: the relaunch's sizing is launched, and the log says so.
    with _up(port, env=env, cwd=tmp_path) as up:
        runtime = _runtime(base, auth)
        assert runtime["requested"] == {**CUSTOM, "allow_estimator_overrun": False}
        assert (runtime["effective"]["context_per_slot"], runtime["effective"]["slots"]) == (1024, 3)
    assert "local node local: launching with the sizing of its relaunch, custom: 3 slot(s) x 1024 tokens" in up.log
    # What `qiip up` printed before starting is what ran: the relaunch's sizing, from the recorded relaunch.
    line = _plan_line(up.log)
    assert line.startswith("qiip-test-tiny: qiip-test-tiny.gguf (llama), 3 slot(s) × 1024 tokens, f16 K/V, "), line
    assert (
        f" MiB planned, the sizing of its relaunch recorded on {recorded_on} instead of the flags' 2 slot(s) × " in line
    )
    assert f"(to go back to the flags' sizing: relaunch the node with it, or stop and delete {record})" in line

    # The operator changes the node's sizing in the configuration (here `qiip up`'s flags): that wins.
    with _up(port, "--ctx-size", "512", env=env, cwd=tmp_path) as up:
        runtime = _runtime(base, auth)
        assert runtime["requested"]["context_per_slot"] == 512 and runtime["effective"]["slots"] == 2
    assert "local node local: its configuration changed since the relaunch" in up.log
    assert "the configured sizing replaces the relaunch's" in up.log
    assert _plan_line(up.log).startswith("qiip-test-tiny: qiip-test-tiny.gguf (llama), 2 slot(s) × 512 tokens, ")
    assert _plan_line(up.log).endswith(" MiB planned")
    assert "local" not in (record.read_text() if record.exists() else "{}")

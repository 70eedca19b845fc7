"""`qiip up`, the main job in one command, as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from qiip_cli._up import _previous_credentials, _write_console_config
from qiip_core.config import load_settings
from tests.support.daemon import free_port

pytestmark = pytest.mark.integration


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and str(os.getpid()) != entry.name:
            found.append(int(entry.name))
    return found


def test_up_serves_until_ctrl_c_and_leaves_nothing_behind(tmp_path: Path, llama_server_binary: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")}
    env |= {
        "QIIP_STATE_DIR": str(tmp_path / "state"),
        "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(llama_server_binary),
    }
    with subprocess.Popen(
        [sys.executable, "-c", "from qiip_cli import main; main()", "up", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        try:
            assert up.stdout is not None and up.stderr is not None
            line = up.stdout.readline()
            assert line == f"OpenAI base URL: http://127.0.0.1:{port}/v1\n", line or up.stderr.read()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            assert [m.id for m in client.models.list()] == ["qiip-test-tiny"]
            reply = client.chat.completions.create(
                model="qiip-test-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 3
            client.close()
            assert _processes_mentioning(str(tmp_path / "state" / "models"))
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)
    assert up.returncode == 0
    deadline = time.monotonic() + 10
    while _processes_mentioning(str(tmp_path / "state")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(tmp_path / "state")) == []
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_up_refuses_a_busy_port_and_a_missing_model(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")} | {"QIIP_STATE_DIR": str(tmp_path)}
        busy = subprocess.run(
            [sys.executable, "-c", "from qiip_cli import main; main()", "up", "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert busy.returncode == 1 and f"Port {port} on 127.0.0.1 is already in use" in busy.stderr
    missing = subprocess.run(
        [
            sys.executable,
            "-c",
            "from qiip_cli import main; main()",
            "up",
            "--model",
            str(tmp_path / "x.gguf"),
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "does not exist" in missing.stderr


def test_up_fails_fast_when_its_model_cannot_load(tmp_path: Path, llama_server_binary: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + os.urandom(4096))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QIIP_")}
    env |= {
        "QIIP_STATE_DIR": str(tmp_path / "state"),
        "QIIP_ENGINES__LLAMACPP__SERVER_BINARY": str(llama_server_binary),
    }
    # A console file of a daemon already running on this state directory survives a start that fails.
    (tmp_path / "state").mkdir()
    console_file = tmp_path / "state" / "console.toml"
    console_file.write_text('url = "http://127.0.0.1:8080"\nusername = "qiip"\npassword = "running"\n')
    console_file.chmod(0o600)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from qiip_cli import main; main()",
            "up",
            "--model",
            str(broken),
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "The model 'broken' failed to start: the daemon says why above" in result.stderr
    assert "local node local failed to start" in result.stderr  # the daemon's own line, above
    assert _processes_mentioning(str(tmp_path / "state")) == []
    assert 'password = "running"' in console_file.read_text()


def test_up_keeps_the_console_credentials_of_an_earlier_start(tmp_path: Path) -> None:
    settings = load_settings(state_dir=tmp_path)
    assert _previous_credentials(settings) is None
    path = _write_console_config(settings, "http://127.0.0.1:8080", "qiip", 'pa"ss')
    assert tomllib.loads(path.read_text())["password"] == 'pa"ss'
    assert _previous_credentials(settings) == ("qiip", 'pa"ss')
    path.chmod(0o644)  # one others can read is not trusted (the console refuses it too)
    assert _previous_credentials(settings) is None

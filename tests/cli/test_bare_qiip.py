"""Bare `qiip`: the console in a terminal, the help anywhere else."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import free_port

pytestmark = pytest.mark.integration


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return clean_environ() | {"QIIP_STATE_DIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"), **extra}


def test_without_a_terminal_bare_qiip_prints_the_help(tmp_path: Path) -> None:
    done = subprocess.run(QIIP, env=_env(tmp_path), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage:") and "console" in done.stdout


def test_in_a_terminal_bare_qiip_opens_the_console(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = _env(tmp_path, QIIP_URL=url, TERM="xterm-256color", COLUMNS="100", LINES="30")
    controller, terminal = pty.openpty()
    process = subprocess.Popen(QIIP, env=env, stdin=terminal, stdout=terminal, stderr=terminal, close_fds=True)
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"does not answer" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(controller, 65536)
                except OSError:
                    break
        assert b"does not answer" in seen, seen[-2000:]
        os.write(controller, b"q")
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            # Keep reading: a console writing its last frame into a full terminal would wait for us.
            if select.select([controller], [], [], 0.2)[0]:
                try:
                    os.read(controller, 65536)
                except OSError:
                    break
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)

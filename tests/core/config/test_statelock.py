"""One daemon's local nodes per state directory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from qiip_core import ConfigError
from qiip_core.config import StateDirLock, local_nodes_in_use


def test_the_lock_is_exclusive_until_released(tmp_path):
    state = tmp_path / "state"
    first = StateDirLock(state)
    assert "Another QIIP daemon runs local nodes from the state directory" in (local_nodes_in_use(state) or "")
    with pytest.raises(ConfigError, match=r"QIIP_STATE_DIR=/some/dir"):
        StateDirLock(state)
    first.release()
    first.release()
    assert local_nodes_in_use(state) is None
    StateDirLock(state).release()


def test_another_process_holding_it_is_seen(tmp_path):
    holder = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from qiip_core.config import StateDirLock
        lock = StateDirLock(Path({str(tmp_path)!r}))
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as p:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline() == "held\n"
        assert local_nodes_in_use(tmp_path) is not None
        p.stdin.close()
        p.wait(timeout=30)
    # The lock dies with its process.
    assert local_nodes_in_use(tmp_path) is None


def test_an_unwritable_state_directory_is_named(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match=r"cannot be written"):
        StateDirLock(blocked / "state")

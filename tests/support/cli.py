"""Run the `qiip` command of this checkout in a subprocess, as a user runs it, with only the settings a test gives."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support.zygote import CLI_CODE, run_to_end

QIIP = [sys.executable, "-c", CLI_CODE]
"""The argv that runs `qiip` on this interpreter (its console script need not be on PATH)."""


def clean_environ() -> dict[str, str]:
    """This process's environment without its `QIIP_` settings, so a subprocess sees only those a test sets."""
    return {name: value for name, value in os.environ.items() if not name.startswith("QIIP_")}


def untraced_environ() -> dict[str, str]:
    """This process's environment without coverage's settings, for a helper process that is not QIIP's code (a
    reference reader, an emulator): coverage would trace it for nothing, at twice its CPU."""
    return {name: value for name, value in os.environ.items() if not name.startswith("COVERAGE_")}


def run_qiip(
    state_dir: Path, *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """Run `qiip ARGS` to its end on the state directory `state_dir`, which is also its working directory, with stdin
    from /dev/null: a fork of this test process's zygote where the environment allows (tests/support/zygote.py), else
    a new process.

    Args:
        state_dir: its `QIIP_STATE_DIR`, and the directory it runs in (so no `.env` of the checkout applies).
        args: the command line after `qiip`.
        env: settings on top of the clean environment (`clean_environ()`).
        timeout_s: seconds it may take.

    Returns:
        The finished process, with its output and errors as text.

    Raises:
        subprocess.TimeoutExpired: it ran longer than `timeout_s`.
    """
    environ = clean_environ() | dict(env or {}) | {"QIIP_STATE_DIR": str(state_dir)}
    return run_to_end("qiip", args, environ, state_dir, timeout_s)

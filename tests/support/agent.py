"""Run `qiip agent` of this checkout as a subprocess, as a GPU node runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.cli import QIIP, clean_environ
from tests.support.daemon import stop_process


class Agent:
    """A `qiip agent` process with its own state directory and log.

    Args:
        state_dir: its `QIIP_STATE_DIR` and working directory.
        env: its settings (and `LD_LIBRARY_PATH` for the NVML stub), on top of a clean environment.
        args: arguments after `qiip agent`.
    """

    def __init__(self, state_dir: Path, *, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        self.state_dir = state_dir
        self.env = clean_environ() | env | {"QIIP_STATE_DIR": str(state_dir)}
        self.args = args
        self.log_path = state_dir / "agent.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*QIIP, "agent", *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.state_dir
        )
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = 15) -> int:
        """Stop it with `sig` (SIGTERM by default) and return its exit code."""
        if self.process is None:
            return 0
        return stop_process(self.process, sig=sig, timeout_s=30)

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

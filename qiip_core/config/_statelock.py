"""One daemon's local llama.cpp nodes per state directory.

A daemon that launches local nodes writes their logs (`logs/<node id>.log`) and the console's credentials under its
state directory, with node ids (`local`, `local-2`, …) that another daemon on the same directory would use too: the
second would read the first one's server logs as its own. The daemon holds an exclusive `flock` on
`<state_dir>/local-nodes.lock` while it runs local nodes, and `qiip up` looks at it before it starts anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from qiip_core._errors import ConfigError

__all__ = ["LOCAL_NODES_LOCK", "StateDirLock", "local_nodes_in_use"]

LOCAL_NODES_LOCK = "local-nodes.lock"
"""The lock file's name in the state directory."""


def _message(state_dir: Path) -> str:
    return (
        f"Another QIIP daemon runs local nodes from the state directory {state_dir}; stop it (Ctrl-C in its "
        "terminal), or give this one a state directory of its own: QIIP_STATE_DIR=/some/dir."
    )


class StateDirLock:
    """The exclusive lock on a state directory's local nodes, held until `release`.

    Args:
        state_dir: the daemon's state directory (created if missing).

    Raises:
        ConfigError: another process holds it (the message says what to do), or the directory cannot be written.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCAL_NODES_LOCK
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"The state directory {state_dir} cannot be written: {exc.strerror}.") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise ConfigError(_message(state_dir)) from None

    def release(self) -> None:
        """Let another daemon use the state directory's local nodes. Idempotent."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def local_nodes_in_use(state_dir: Path) -> str | None:
    """Why `state_dir` cannot take another daemon's local nodes now, or None when it can.

    Args:
        state_dir: a state directory.

    Returns:
        The sentence to show (another daemon holds the lock), or None.
    """
    try:
        StateDirLock(state_dir).release()
    except ConfigError as exc:
        return exc.message
    return None

"""The state directory's lock, and several of its files replaced together: all of them or none, even across a kill -9.

Each `LockedJsonFile` (the registrations, tokens, provisioning records, deployments, their statuses, the host pool)
is rewritten atomically on its own. A backup must read all of them as of one moment, and a restore must replace all
of them at once. So every `LockedJsonFile` operation holds `<state_dir>/state.lock` shared (besides its own file's
lock), and a backup or a restore holds it exclusive: while it does, no process changes any of them.

`StateLock.replace_files` is a redo journal:

```
1. each new file is written and fsynced in <state_dir>/.state-replace/       (killed here: the old state)
2. <state_dir>/state-replace.journal names them, written atomically           (the commit point)
3. each staged file is renamed over its live one, then the journal removed    (killed here: the new state)
```

Whoever takes the lock next (any reader or writer of any process) first finishes a journal it finds (step 3, which
is idempotent) and removes staged files no journal names (step 1 of a restore that died before its commit). No
reader ever sees some files old and others new.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from qiip_core.storage._atomic import atomic_write

__all__ = ["JOURNAL_NAME", "STAGING_DIR_NAME", "STATE_LOCK_NAME", "StateLock"]

STATE_LOCK_NAME = "state.lock"
"""The lock file's name in the state directory."""
JOURNAL_NAME = "state-replace.journal"
"""The journal of a replacement that has passed its commit point."""
STAGING_DIR_NAME = ".state-replace"
"""Where a replacement's new files are written before its commit point."""

_held = threading.local()
"""The state directories this thread holds the lock of, with how deeply: a nested acquisition is already covered."""


def _depths() -> dict[Path, int]:
    depths: dict[Path, int] | None = getattr(_held, "depths", None)
    if depths is None:
        depths = _held.depths = {}
    return depths


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(state_dir: Path) -> None:
    """Finish a replacement past its commit point, or remove one that died before it. Idempotent."""
    journal = state_dir / JOURNAL_NAME
    staging = state_dir / STAGING_DIR_NAME
    try:
        names = json.loads(journal.read_bytes())["files"]
    except FileNotFoundError:
        names = None
    if names is not None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # renamed before the kill
                os.replace(staging / name, state_dir / name)
        _fsync_dir(state_dir)
        journal.unlink()
        _fsync_dir(state_dir)
    if staging.exists():
        shutil.rmtree(staging)


class StateLock:
    """The lock on a state directory's documents, as a context manager.

    Shared: what every `LockedJsonFile` read or write holds. Exclusive: what a backup holds while it reads every
    document and a restore while it replaces them (`replace_files`). Taking it finishes (or removes) a replacement
    a killed process left. A thread that holds it already (a restore reading the documents it replaces) passes
    through a nested acquisition.

    Args:
        state_dir: the state directory (created if missing).
        exclusive: exclusive (a backup, a restore) or shared (one document's read or write).

    Raises:
        OSError: the directory or the lock file cannot be used (on entering).
    """

    def __init__(self, state_dir: Path, *, exclusive: bool) -> None:
        self.state_dir = state_dir
        self.exclusive = exclusive
        self._key = Path(os.path.abspath(state_dir))
        self._fd: int | None = None

    def __enter__(self) -> StateLock:
        depths = _depths()
        if depths.get(self._key):
            depths[self._key] += 1
            return self
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / STATE_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
            if self._left_over():
                # A converted flock is released, then taken anew (flock(2)), so two readers converting at once
                # cannot wait on each other; the one that comes second finds nothing left to finish.
                fcntl.flock(fd, fcntl.LOCK_EX)
                if self._left_over():
                    _finish(self.state_dir)
                if not self.exclusive:
                    fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        depths[self._key] = 1
        return self

    def _left_over(self) -> bool:
        return (self.state_dir / JOURNAL_NAME).exists() or (self.state_dir / STAGING_DIR_NAME).exists()

    def __exit__(self, *exc: object) -> None:
        depths = _depths()
        depths[self._key] -= 1
        if depths[self._key]:
            return
        del depths[self._key]
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def replace_files(self, files: Mapping[str, bytes], *, on_step: Callable[[str], None] | None = None) -> None:
        """Replace the documents `files` (name → content, mode 0600) together: all of them, or none.

        Args:
            files: plain file names in the state directory and their new content.
            on_step: called with `staged`, `committed`, `replaced <name>` after each step (for tests that kill the
                process at each one).

        Raises:
            ValueError: a name is not a plain file name, or the lock is not held exclusive.
            OSError: the directory cannot be written (before the commit point nothing changed).
        """
        if not self.exclusive or self._fd is None:
            raise ValueError("replace_files needs the state lock held exclusive")
        for name in files:
            if not name or name != os.path.basename(name) or name.startswith("."):
                raise ValueError(f"{name!r} is not a plain file name")
        step = on_step or (lambda _: None)
        staging = self.state_dir / STAGING_DIR_NAME
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(mode=0o700)
        for name, data in files.items():
            atomic_write(staging / name, data)
        _fsync_dir(staging)
        step("staged")
        atomic_write(self.state_dir / JOURNAL_NAME, json.dumps({"files": sorted(files)}).encode())
        step("committed")
        for name in sorted(files):
            os.replace(staging / name, self.state_dir / name)
            step(f"replaced {name}")
        _finish(self.state_dir)

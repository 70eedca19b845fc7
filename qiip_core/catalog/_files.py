"""The file primitives the object store and the model store stand on: an exclusive lock per object or revision,
positional writes, and hashing a file as it reads back from disk.

The lock is a `flock`, per open file, so it excludes other threads of this process as well as other processes and
gateways on the same store, and the kernel drops it when its holder dies: a killed acquisition never leaves an
object locked. Hashes are taken over the bytes as the file reads back, never as they were received or written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["HASH_BLOCK", "exclusive_lock", "fsync_dir", "hash_back", "lock_held", "sha256_of", "write_all"]

HASH_BLOCK = 1 << 20
"""Bytes read back into one buffer to be hashed."""
_LOCK_POLL_S = 0.05
"""How often a waiting acquisition looks at the lock again (and at a pause request)."""


@contextlib.contextmanager
def exclusive_lock(path: Path, *, check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if absent) for the block; wait while another holder has it.

    The lock is per open file, so it excludes other threads of this process as well as other processes; the
    kernel drops it when its holder dies, so a killed acquisition never leaves the object locked.

    Args:
        path: the lock file.
        check: called while waiting; what it raises (a pause) ends the wait.

    Raises:
        OSError: the lock file cannot be created.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
            check()
            time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def lock_held(path: Path) -> bool:
    """Whether some holder (this process included) has an exclusive lock on `path` now; False when it does not
    exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """`pwrite` all of `data` at `offset`, however many calls it takes."""
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def hash_back(fd: int, digest: Any, start: int, end: int, buffer: bytearray | None = None) -> None:
    """Feed `digest` the bytes `[start, end)` of the file as it reads back now (into `buffer`, reused)."""
    view = memoryview(buffer if buffer is not None else bytearray(HASH_BLOCK))
    position = start
    while position < end:
        n = os.preadv(fd, [view[: min(len(view), end - position)]], position)
        if not n:
            raise OSError(errno.EIO, f"the file ends at byte {position:,}, before {end:,} it was written to")
        digest.update(view[:n])
        position += n


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file at `path`, as it reads back now (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make a rename or a creation in `directory` durable (fsync the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

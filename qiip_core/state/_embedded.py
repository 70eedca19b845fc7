"""The embedded backend's side: every document of the state directory read, or replaced, under its lock.

A snapshot holds the state directory's lock exclusive while it reads the six documents, so no process writes one
of them meanwhile (`qiip_core.storage.StateLock`). A restore holds it from reading the current state to the last
rename, and replaces the documents with `StateLock.replace_files`: a kill -9 at any step leaves the old state or,
once the journal is written, the new one, finished by whoever takes the lock next.
"""

from __future__ import annotations

import fcntl
import json
import os
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qiip_core._errors import StateError
from qiip_core.provisioning import LEASE_DIR_NAME
from qiip_core.state._file import Snapshot
from qiip_core.state._kinds import KINDS
from qiip_core.storage import StateLock

if TYPE_CHECKING:
    from pathlib import Path

    from qiip_core.config import Settings

__all__ = ["busy_hosts_embedded", "locked", "read_embedded", "replace_embedded"]


def locked(settings: Settings) -> StateLock:
    """The state directory's lock, exclusive: hold it around `read_embedded` and `replace_embedded`.

    Raises:
        StateError: the directory cannot be used (on entering; see `StateLock`).
    """
    return _Locked(settings.state_dir, exclusive=True)


class _Locked(StateLock):
    def __enter__(self) -> StateLock:
        try:
            return super().__enter__()
        except OSError as exc:
            raise StateError(
                f"The state directory {self.state_dir} cannot be used ({exc.strerror}); set QIIP_STATE_DIR to a "
                "writable directory."
            ) from exc


def read_embedded(settings: Settings) -> Snapshot:
    """Every document of the state directory (hold `locked(settings)` for one moment's).

    Raises:
        QiipError: a document cannot be read or is not a QIIP document (each store's own error).
    """
    snapshot = Snapshot(backend="embedded", where=str(settings.state_dir))
    for kind in KINDS:
        items = kind.document(settings).read()
        snapshot.entries[kind.name] = {item_id: kind.canonical(item) for item_id, item in items.items()}
    return snapshot


def replace_embedded(
    settings: Settings, lock: StateLock, snapshot: Snapshot, *, on_step: Callable[[str], None] | None = None
) -> None:
    """Replace every document with `snapshot`'s entries, all at once (the lock held exclusive).

    Raises:
        StateError: the state directory cannot be written; nothing changed.
    """
    files: dict[str, bytes] = {}
    for kind in KINDS:
        document = kind.document(settings)
        entries: list[Any] = [snapshot.entries[kind.name][i] for i in sorted(snapshot.entries[kind.name])]
        files[document.path.name] = json.dumps({"version": 1, document.items_key: entries}, indent=2).encode() + b"\n"
    try:
        lock.replace_files(files, on_step=on_step)
    except OSError as exc:
        raise StateError(
            f"The state directory {settings.state_dir} cannot be written ({exc.strerror}); nothing was changed."
        ) from exc


def busy_hosts_embedded(settings: Settings) -> list[str]:
    """The hosts a provisioning operation holds the lease of now (an `flock` some process holds)."""
    lease_dir: Path = settings.state_dir / LEASE_DIR_NAME
    try:
        names = sorted(os.listdir(lease_dir))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StateError(f"The lease directory {lease_dir} cannot be read ({exc.strerror}).") from exc
    busy = []
    for name in names:
        try:
            fd = os.open(lease_dir / name, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy.append(urllib.parse.unquote(name))
        finally:
            os.close(fd)
    return busy

"""The embedded registry's state file: registrations kept across restarts, shared by the daemon and the CLI.

`<state_dir>/nodes.json` holds `{"version": 1, "nodes": [<node>, …]}`. Readers take a shared `flock` on
`<state_dir>/nodes.lock`, writers an exclusive one around read-modify-write, and every write goes to a
temporary file in the same directory that is fsynced and renamed over the old one, so a crash at any
point leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qiip_core._errors import RegistryUnavailable
from qiip_core.nodes import Node

__all__ = ["STATE_FILE_NAME", "StateFile", "atomic_write"]

logger = logging.getLogger("qiip.discovery")

STATE_FILE_NAME = "nodes.json"
_VERSION = 1


def atomic_write(path: Path, data: bytes, *, mode: int = 0o600) -> None:
    """Write `data` to `path` atomically: a temporary file in the same directory, fsync, rename, fsync dir.

    Raises:
        OSError: the directory cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class StateFile:
    """The registrations file under a state directory.

    Args:
        state_dir: the directory (`QIIP_STATE_DIR`); created on first write.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / STATE_FILE_NAME
        self._lock_path = state_dir / "nodes.lock"

    @contextlib.contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        try:
            self._lock_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RegistryUnavailable(
                f"The state directory {self._lock_path.parent} cannot be used ({exc.strerror}); "
                "set QIIP_STATE_DIR to a writable directory."
            ) from exc
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)

    def signature(self) -> tuple[int, int, int] | None:
        """(mtime_ns, size, inode) of the file, or None when it does not exist: cheap change detection."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def read(self) -> dict[str, Node]:
        """The registrations in the file; an entry that no longer validates is skipped with a warning.

        Raises:
            RegistryUnavailable: the file cannot be read or is not a QIIP state file.
        """
        with self._locked(fcntl.LOCK_SH):
            return self._read_unlocked()[0]

    def _read_unlocked(self) -> tuple[dict[str, Node], list[Any]]:
        """(valid registrations, raw entries that do not validate): the latter are kept on rewrite."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, []
        except OSError as exc:
            raise RegistryUnavailable(f"The state file {self.path} cannot be read ({exc.strerror}).") from exc
        try:
            doc = json.loads(raw)
            entries = doc["nodes"]
            if doc.get("version") != _VERSION or not isinstance(entries, list):
                raise ValueError("unsupported version or layout")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RegistryUnavailable(
                f"The state file {self.path} is not a valid QIIP state file ({exc}); "
                "move it aside to start with an empty registry."
            ) from exc
        nodes: dict[str, Node] = {}
        invalid: list[Any] = []
        for index, entry in enumerate(entries):
            try:
                node = Node.model_validate(entry)
            except ValidationError as exc:
                name = entry.get("id") if isinstance(entry, dict) else None
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                logger.warning(
                    "%s: entry %s is invalid and is ignored (kept in the file): %s: %s",
                    self.path,
                    repr(name) if name is not None else f"#{index}",
                    where,
                    first["msg"],
                )
                invalid.append(entry)
                continue
            nodes[node.id] = node
        return nodes, invalid

    def update(self, change: Callable[[dict[str, Node]], dict[str, Node]]) -> dict[str, Node]:
        """Read, change and write the registrations under an exclusive lock.

        Args:
            change: gets the current registrations and returns the new ones; an exception it raises aborts
                the update and leaves the file untouched.

        Returns:
            The registrations written.

        Raises:
            RegistryUnavailable: the file cannot be read or written.
        """
        with self._locked(fcntl.LOCK_EX):
            current, invalid = self._read_unlocked()
            nodes = change(current)
            doc = {
                "version": _VERSION,
                "nodes": [nodes[k].model_dump(mode="json", exclude_none=True) for k in sorted(nodes)] + invalid,
            }
            try:
                atomic_write(self.path, json.dumps(doc, indent=2).encode() + b"\n")
            except OSError as exc:
                raise RegistryUnavailable(f"The state file {self.path} cannot be written ({exc.strerror}).") from exc
            return nodes

"""Files that are never half-written: `atomic_write`, and `LockedJsonFile`, a locked JSON document of entries.

Shared by the daemon, the CLI and the console: the registry's state file and the token file are
`LockedJsonFile`s; `qiip up`'s console credentials and the console's remembered preferences are written with
`atomic_write`.

A document is `{"version": 1, "<items>": [<entry>, …]}`, mode 0600. Readers take a shared `flock` on a
lock file next to it, writers an exclusive one around read-modify-write, and every write goes to a
temporary file in the same directory that is fsynced and renamed over the old one, so a crash at any
point leaves either the old file or the new one, never half of one. An entry that does not validate is
skipped with a warning and kept in the file on rewrite; a file of another shape is an error the operator
must resolve.

```
LockedJsonFile[T]   lock, read, validate, keep invalid entries, atomic rewrite, signature
├── StateFile       <state_dir>/nodes.json (registrations; qiip_core.discovery)
└── TokenFile       <state_dir>/tokens.json (invoke tokens; qiip_core.auth)
```
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from pydantic import ValidationError

from qiip_core._errors import QiipError
from qiip_core._violation import first_violation
from qiip_core.storage._atomic import atomic_write
from qiip_core.storage._statelock import StateLock

__all__ = ["LockedJsonFile"]

_VERSION = 1


class _Entry(Protocol):
    """What an item of a document is: a pydantic model with an `id`."""

    @property
    def id(self) -> str: ...

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...

    def model_dump(self, *, mode: str = ..., exclude_none: bool = ...) -> dict[str, Any]: ...


_T = TypeVar("_T", bound=_Entry)


class LockedJsonFile(Generic[_T]):
    """A JSON document of entries with an `id`, locked with `flock` and rewritten atomically.

    A subclass names the document, its model and the wording of its errors; the lock file is the
    document's path with the suffix `.lock`.

    Args:
        state_dir: the directory (`QIIP_STATE_DIR`); created on first write.
    """

    file_name: ClassVar[str]
    """The document's name under the state directory (`nodes.json`)."""
    items_key: ClassVar[str]
    """The document's list of entries (`nodes`)."""
    model: type[_T]
    """The model each entry validates as."""
    exclude_none: ClassVar[bool] = False
    """Whether fields that are None are left out of the entries written."""
    noun: ClassVar[str]
    """What the file is called in messages (`state file`)."""
    fresh_start: ClassVar[str]
    """What moving an unusable file aside leads to, for its error message (`start with an empty registry`)."""
    entry_noun: ClassVar[str] = "entry"
    """What an entry is called in the warning about an invalid one."""
    error: ClassVar[type[QiipError]]
    """The error raised when the file or its directory cannot be used."""
    log: ClassVar[logging.Logger]
    """Where warnings about invalid entries go."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / self.file_name
        self._lock_path = self.path.with_suffix(".lock")

    def _set_aside(self, item: _T) -> bool:
        """Whether an entry whose id an earlier entry has is kept aside (True) or replaces it (False)."""
        return False

    def _kept(self, items: dict[str, _T]) -> dict[str, _T]:
        """The items a rewrite keeps, of those `update`'s change returned (all of them here)."""
        return items

    @contextlib.contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        with contextlib.ExitStack() as held:
            try:
                self._lock_path.parent.mkdir(parents=True, exist_ok=True)
                # The state directory's lock, shared around every read and write: a backup or a restore (holding it
                # exclusive) then sees or replaces every document of the directory at one moment (`StateLock`).
                held.enter_context(StateLock(self.path.parent, exclusive=False))
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                raise self._unusable(exc) from exc
            held.callback(os.close, fd)
            fcntl.flock(fd, kind)
            yield

    def _unusable(self, exc: OSError) -> QiipError:
        return self.error(
            f"The state directory {self._lock_path.parent} cannot be used ({exc.strerror}); "
            "set QIIP_STATE_DIR to a writable directory."
        )

    def signature(self) -> tuple[int, int, int] | None:
        """(mtime_ns, size, inode) of the file, or None when it does not exist: cheap change detection."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def read(self) -> dict[str, _T]:
        """The items in the file by id; an entry that does not validate is skipped with a warning.

        Raises:
            QiipError: (the class's `error`) the file cannot be read or is not a document of this kind.
        """
        with self._locked(fcntl.LOCK_SH):
            return self._read_unlocked()[0]

    def _read_unlocked(self) -> tuple[dict[str, _T], list[Any]]:
        """(valid items, raw entries that do not validate): the latter are kept on rewrite."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}, []
        except OSError as exc:
            raise self.error(f"The {self.noun} {self.path} cannot be read ({exc.strerror}).") from exc
        try:
            doc = json.loads(raw)
            entries = doc[self.items_key]
            if doc.get("version") != _VERSION or not isinstance(entries, list):
                raise ValueError("unsupported version or layout")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self.error(
                f"The {self.noun} {self.path} is not a valid QIIP {self.noun} ({exc}); "
                f"move it aside to {self.fresh_start}."
            ) from exc
        items: dict[str, _T] = {}
        invalid: list[Any] = []
        for index, entry in enumerate(entries):
            try:
                item = self.model.model_validate(entry)
            except ValidationError as exc:
                name = entry.get("id") if isinstance(entry, dict) else None
                error = first_violation(exc)
                self.log.warning(
                    "%s: %s %s is invalid and is ignored (kept in the file): %s: %s",
                    self.path,
                    self.entry_noun,
                    repr(name) if isinstance(name, str) else f"#{index}",
                    error.field,
                    error.message,
                )
                invalid.append(entry)
                continue
            if item.id in items and self._set_aside(item):
                invalid.append(entry)
                continue
            items[item.id] = item
        return items, invalid

    def update(self, change: Callable[[dict[str, _T]], dict[str, _T]]) -> dict[str, _T]:
        """Read, change and write the items under an exclusive lock.

        Args:
            change: gets the current items and returns the new ones; an exception it raises aborts the
                update and leaves the file untouched.

        Returns:
            The items written.

        Raises:
            QiipError: (the class's `error`) the file cannot be read or written.
        """
        with self._locked(fcntl.LOCK_EX):
            current, invalid = self._read_unlocked()
            items = self._kept(change(current))
            entries = [items[k].model_dump(mode="json", exclude_none=self.exclude_none) for k in sorted(items)]
            doc = {"version": _VERSION, self.items_key: entries + invalid}
            try:
                atomic_write(self.path, json.dumps(doc, indent=2).encode() + b"\n")
            except OSError as exc:
                raise self.error(f"The {self.noun} {self.path} cannot be written ({exc.strerror}).") from exc
            return items

"""The backup file: one versioned, self-describing JSON document with a checksum.

```
{"format": "qiip-state-backup", "format_version": 1, "qiip_version": "0.9.0",
 "created_at": "2026-12-07T10:00:00Z",
 "source": {"backend": "etcd", "where": "http://127.0.0.1:2379", "revision": 4711},
 "counts": {"nodes": 2, …},
 "kinds": {"nodes": [{"id": "gpu01", …}, …], "hosts": […], "deployments": […], "deployment_statuses": […],
           "tokens": […], "provisioning": […]},
 "sha256": "<hex>"}
```

`sha256` is the SHA-256 of the document without it, as compact JSON with sorted keys: a byte changed in any entry
(or a field added) no longer matches, however the file was re-indented. Tokens are held as their hashes, never
their secrets (a backup lets no one call the fleet). `decode_backup` refuses a truncated, tampered, newer-format or
foreign file, or an entry that does not validate, with one reason naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from pydantic import ValidationError

from qiip_core._errors import BackupInvalid
from qiip_core._violation import first_violation
from qiip_core.state._kinds import KINDS, kind_named

__all__ = ["FORMAT", "FORMAT_VERSION", "MAX_BACKUP_BYTES", "Backup", "Snapshot", "decode_backup", "encode_backup"]

FORMAT = "qiip-state-backup"
"""The `format` of every QIIP state backup."""
FORMAT_VERSION = 1
"""The layout this QIIP writes and reads; a file of a larger one is refused (written by a newer QIIP)."""
MAX_BACKUP_BYTES = 64 * 1024 * 1024
"""A backup larger than this (64 MiB) is refused unread: a fleet's whole state is a few MiB."""


@dataclass(slots=True)
class Snapshot:
    """The state of one backend at one moment.

    Attributes:
        backend: `embedded` or `etcd`.
        where: the state directory, or the etcd endpoint read.
        revision: etcd's store revision the snapshot was read at (None for the embedded backend).
        entries: kind name → entry id → canonical entry (`Kind.canonical`), for every kind of `KINDS`.
    """

    backend: str
    where: str
    revision: int | None = None
    entries: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {k.name: {} for k in KINDS})

    def counts(self) -> dict[str, int]:
        """How many entries of each kind."""
        return {name: len(items) for name, items in self.entries.items()}

    def empty(self) -> bool:
        """Whether it holds no entry of any kind."""
        return not any(self.entries.values())


@dataclass(frozen=True, slots=True)
class Backup:
    """A decoded backup file.

    Attributes:
        snapshot: the state it holds.
        qiip_version: the QIIP that wrote it.
        created_at: when (UTC, ISO 8601).
    """

    snapshot: Snapshot
    qiip_version: str
    created_at: str


def _qiip_version() -> str:
    try:
        return metadata.version("qiip")
    except metadata.PackageNotFoundError:
        return "unknown"


def _digest(document: dict[str, Any]) -> str:
    body = {k: v for k, v in document.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_backup(snapshot: Snapshot, *, now: datetime | None = None) -> bytes:
    """The backup file of `snapshot`: UTF-8 JSON, one entry a line group, keys sorted, with its checksum."""
    document: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "qiip_version": _qiip_version(),
        "created_at": (now or datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
        "source": {"backend": snapshot.backend, "where": snapshot.where, "revision": snapshot.revision},
        "counts": snapshot.counts(),
        "kinds": {
            kind.name: [snapshot.entries[kind.name][i] for i in sorted(snapshot.entries[kind.name])] for kind in KINDS
        },
    }
    document["sha256"] = _digest(document)
    return json.dumps(document, indent=1, sort_keys=True).encode() + b"\n"


def _entries(name: str, raw: Any) -> dict[str, dict[str, Any]]:
    kind = kind_named(name)
    if kind is None:
        raise BackupInvalid(f"it holds an unknown kind {name!r} (a newer QIIP's, or an edited file)")
    if not isinstance(raw, list):
        raise BackupInvalid(f"its {name} is not a list")
    found: dict[str, dict[str, Any]] = {}
    for index, entry in enumerate(raw):
        try:
            item = kind.validate(entry)
        except ValidationError as exc:
            violation = first_violation(exc)
            raise BackupInvalid(f"{name} entry {index + 1}: {violation.field}: {violation.message}") from None
        item_id = str(getattr(item, "id"))  # noqa: B009 - every kind's model has an `id` property
        if item_id in found:
            raise BackupInvalid(f"{name} holds {item_id!r} twice")
        found[item_id] = kind.canonical(item)
    return found


def decode_backup(data: bytes) -> Backup:
    """Read and check a backup file.

    Args:
        data: the file's bytes.

    Returns:
        The backup, every entry validated.

    Raises:
        BackupInvalid: the file is too large, not whole JSON (truncated), not a QIIP state backup, of a newer
            format, its checksum does not match its content (tampered or damaged), or an entry does not validate;
            the reason names what is wrong.
    """
    if len(data) > MAX_BACKUP_BYTES:
        raise BackupInvalid(f"it is larger than {MAX_BACKUP_BYTES // (1024 * 1024)} MiB")
    try:
        # Decoded here, not by json.loads: given bytes, it guesses UTF-16 or UTF-32 from the first bytes.
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BackupInvalid("it is not UTF-8 text (not a QIIP state backup)") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise BackupInvalid(f"it is not whole JSON, truncated or damaged ({exc})") from None
    except RecursionError:
        raise BackupInvalid("it nests arrays or objects too deeply (not a QIIP state backup)") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise BackupInvalid(f'it is not a QIIP state backup (no "format": "{FORMAT}")')
    version = document.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BackupInvalid(f"its format_version {version!r} is not a version this QIIP knows")
    if version > FORMAT_VERSION:
        raise BackupInvalid(
            f"its format version {version} is newer than this QIIP reads ({FORMAT_VERSION}); it was written by "
            f"QIIP {document.get('qiip_version')!r}: restore it with that version or later"
        )
    if not isinstance(document.get("sha256"), str) or document["sha256"] != _digest(document):
        raise BackupInvalid("its checksum does not match its content: it was changed or damaged after it was written")
    source = document.get("source")
    kinds = document.get("kinds")
    if not isinstance(source, dict) or source.get("backend") not in ("embedded", "etcd"):
        raise BackupInvalid("its source names no backend (embedded or etcd)")
    if not isinstance(kinds, dict):
        raise BackupInvalid("it holds no kinds")
    revision = source.get("revision")
    snapshot = Snapshot(
        backend=source["backend"],
        where=str(source.get("where", "")),
        revision=revision if isinstance(revision, int) else None,
    )
    for name, raw in kinds.items():
        snapshot.entries[name] = _entries(name, raw)
    return Backup(snapshot, str(document.get("qiip_version", "unknown")), str(document.get("created_at", "")))

"""Backup, restore and migrate: what `qiip state` and `/admin/state` run, on either backend.

```
take_backup(settings)                        → (file bytes, Snapshot)  one moment's state of the configured backend
restore(settings, data, replace=, dry_run=)  → RestoreReport           the file's state, all of it or none
migrate(settings, to=, replace=, dry_run=)   → RestoreReport           embedded → etcd, or etcd → embedded
```

A restore checks the whole file (`decode_backup`) and the target before it writes anything: an empty target
unless `replace`, no provisioning operation running, every node's endpoint inside this configuration's allowlist
and its id free of the configuration's own nodes. `dry_run` reports what would change (added, changed, removed,
per kind) and why a real run would be refused, changing nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from qiip_core._errors import EndpointError, NodeConflict, StateConflict
from qiip_core.discovery import check_free_id
from qiip_core.state._embedded import busy_hosts_embedded, locked, read_embedded, replace_embedded
from qiip_core.state._etcd import apply_etcd, busy_hosts_etcd, read_etcd
from qiip_core.state._file import Snapshot, decode_backup, encode_backup
from qiip_core.state._kinds import KINDS
from qiip_core.storage import EtcdClient

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["KindChanges", "RestoreReport", "migrate", "restore", "take_backup"]

logger = logging.getLogger("qiip.state")

Backend = Literal["embedded", "etcd"]

_ATTEMPTS = 3
"""Times an etcd restore reads and applies again when the fleet wrote a key between its read and its transaction."""


@dataclass(slots=True)
class KindChanges:
    """What a restore changes in one kind, by entry id."""

    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0


@dataclass(slots=True)
class RestoreReport:
    """What a restore or a migration changed (or, with `dry_run`, would change).

    Attributes:
        target: the backend written (`embedded`, `etcd`).
        where: its state directory or etcd endpoint.
        dry_run: nothing was written.
        changes: kind name → its changes, for every kind.
        refused: (dry runs) why a real run would be refused, or None.
    """

    target: str
    where: str
    dry_run: bool
    changes: dict[str, KindChanges]
    refused: str | None = None

    def view(self) -> dict[str, Any]:
        """The report as JSON (the admin API's answer)."""
        return {
            "target": self.target,
            "where": self.where,
            "dry_run": self.dry_run,
            "refused": self.refused,
            "changes": {
                name: {"added": c.added, "changed": c.changed, "removed": c.removed, "unchanged": c.unchanged}
                for name, c in self.changes.items()
            },
        }

    def lines(self) -> list[str]:
        """The report in words, a line per kind that changes, then the outcome."""
        out = []
        for name, c in self.changes.items():
            if c.added or c.changed or c.removed:
                parts = [
                    f"{label} {len(ids)} ({', '.join(ids[:5])}{', …' if len(ids) > 5 else ''})"
                    for label, ids in (("added", c.added), ("changed", c.changed), ("removed", c.removed))
                    if ids
                ]
                out.append(f"{name}: {'; '.join(parts)}; unchanged {c.unchanged}")
        if not out:
            out.append("nothing to change: the target holds the backup's state already")
        if self.dry_run:
            out.append(f"dry run: nothing was written to {self.target} ({self.where})")
            if self.refused:
                out.append(f"a real run would be refused: {self.refused}")
        else:
            out.append(f"restored into {self.target} ({self.where})")
        return out


def _diff(current: Snapshot, incoming: Snapshot) -> dict[str, KindChanges]:
    changes = {}
    for kind in KINDS:
        now, new = current.entries[kind.name], incoming.entries[kind.name]
        c = KindChanges(
            added=sorted(set(new) - set(now)),
            changed=sorted(i for i in new if i in now and now[i] != new[i]),
            removed=sorted(set(now) - set(new)),
        )
        c.unchanged = len(new) - len(c.added) - len(c.changed)
        changes[kind.name] = c
    return changes


def _describe(snapshot: Snapshot) -> str:
    nouns = {kind.name: kind.noun for kind in KINDS}
    held = [f"{n} {nouns[name]}{'s' if n != 1 else ''}" for name, n in snapshot.counts().items() if n]
    return ", ".join(held)


def _check(settings: Settings, current: Snapshot, incoming: Snapshot, busy: list[str], *, replace: bool) -> None:
    """Raise why the restore cannot go ahead, before anything is written."""
    policy = settings.routing.endpoint_policy()
    for node_id, entry in incoming.entries["nodes"].items():
        try:
            check_free_id(settings, node_id)
            policy.check(str(entry.get("endpoint", "")))
        except (NodeConflict, EndpointError) as exc:
            raise StateConflict(f"The backup's node {node_id!r} cannot be restored here: {exc.message}") from None
    if busy:
        raise StateConflict(
            f"A provisioning operation holds host {busy[0]}{f' (and {len(busy) - 1} more)' if len(busy) > 1 else ''}; "
            "wait for it to finish (qiip node list shows it), then restore."
        )
    if not replace and not current.empty():
        raise StateConflict(
            f"The target ({current.backend}, {current.where}) holds state: {_describe(current)}; restore with "
            "replace (--replace) to make it the backup's, after a dry run (--dry-run) shows what would change."
        )


def take_backup(settings: Settings) -> tuple[bytes, Snapshot]:
    """One moment's state of the configured backend, as a backup file.

    Returns:
        (the file's bytes, the snapshot it holds).

    Raises:
        StateError: the backend cannot be read.
        QiipError: (embedded) a document is not a QIIP document (its store's error).
    """
    if settings.registry.backend == "etcd":
        snapshot = read_etcd(settings)
    else:
        with locked(settings):
            snapshot = read_embedded(settings)
    return encode_backup(snapshot), snapshot


def _into(
    settings: Settings,
    target: Backend,
    incoming: Snapshot,
    *,
    replace: bool,
    dry_run: bool,
    on_step: Callable[[str], None] | None,
) -> RestoreReport:
    if target == "embedded":
        with locked(settings) as lock:
            current = read_embedded(settings)
            report = _report(settings, current, incoming, busy_hosts_embedded(settings), replace, dry_run)
            if not dry_run:
                if on_step is not None:
                    on_step("checked")
                replace_embedded(settings, lock, incoming, on_step=on_step)
        return report
    client = EtcdClient(settings.etcd)
    try:
        for attempt in range(_ATTEMPTS):
            current = read_etcd(settings, client)
            report = _report(settings, current, incoming, busy_hosts_etcd(settings, client), replace, dry_run)
            if dry_run:
                return report
            if on_step is not None:
                on_step("checked")
            try:
                apply_etcd(settings, client, current, incoming, on_step=on_step)
            except StateConflict:
                if attempt + 1 == _ATTEMPTS:
                    raise
                logger.info("the state in etcd changed during the restore; reading it again")
                continue
            return report
        raise AssertionError("unreachable")
    finally:
        client.close()


def _report(
    settings: Settings, current: Snapshot, incoming: Snapshot, busy: list[str], replace: bool, dry_run: bool
) -> RestoreReport:
    report = RestoreReport(current.backend, current.where, dry_run, _diff(current, incoming))
    try:
        _check(settings, current, incoming, busy, replace=replace)
    except StateConflict as exc:
        if not dry_run:
            raise
        report.refused = exc.message
    return report


def restore(
    settings: Settings,
    data: bytes,
    *,
    replace: bool = False,
    dry_run: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> RestoreReport:
    """Restore a backup file into the configured backend: all of its state, or nothing.

    Args:
        settings: the target's settings (`registry.backend`, `state_dir`, `[etcd]`, the endpoint allowlist).
        data: the backup file's bytes.
        replace: make a target that holds state the backup's (entries it lacks are removed).
        dry_run: report what would change, and why a real run would be refused, writing nothing.
        on_step: called at each step (`checked`, then the backend's: `staged`, `committed`, `replaced <file>` for
            the embedded backend, `planned`, `committed` for etcd), for tests that kill the process there.

    Returns:
        What changed (or would).

    Raises:
        BackupInvalid: the file is refused (`decode_backup`); nothing changed.
        StateConflict: the target holds state and `replace` is not given, a provisioning operation runs, a node
            is outside this configuration's allowlist or takes one of its ids, or etcd changed throughout.
        StateError: the backend cannot be read or written; nothing changed.
    """
    backup = decode_backup(data)
    target: Backend = "etcd" if settings.registry.backend == "etcd" else "embedded"
    return _into(settings, target, backup.snapshot, replace=replace, dry_run=dry_run, on_step=on_step)


def migrate(
    settings: Settings,
    *,
    to: Backend,
    replace: bool = False,
    dry_run: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> RestoreReport:
    """Copy the whole state from one backend into the other, with a restore's guarantees.

    `to="etcd"` reads the state directory (its lock held exclusive throughout, so nothing writes it meanwhile) and
    writes `[etcd]`; `to="embedded"` reads etcd at one revision and writes the state directory. The source is left
    as it was; the gateways then move to the target (`registry.backend`) and restart.

    Args:
        settings: both backends' settings (`state_dir` and `[etcd]`).
        to: the target backend.
        replace, dry_run, on_step: as for `restore`.

    Returns:
        What changed in the target (or would).

    Raises:
        StateConflict, StateError: as for `restore`.
    """
    if to == "etcd":
        with locked(settings):
            snapshot = read_embedded(settings)
            if on_step is not None:
                on_step("read")
            return _into(settings, "etcd", snapshot, replace=replace, dry_run=dry_run, on_step=on_step)
    snapshot = read_etcd(settings)
    if on_step is not None:
        on_step("read")
    return _into(settings, "embedded", snapshot, replace=replace, dry_run=dry_run, on_step=on_step)

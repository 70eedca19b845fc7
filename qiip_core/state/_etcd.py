"""The etcd backend's side: every kind's prefix read at one revision, and replaced in one transaction.

A snapshot reads the first prefix at etcd's current revision and every other one at that same revision (the range
request's `revision`), so it is one moment's state however gateways write meanwhile.

A restore is one transaction: a put of each entry that is new or different, a delete of each key the backup does
not hold, guarded by two kinds of comparison over key ranges (etcd's `Compare.range_end`): no key of any kind
changed since the revision the restore read (`mod_revision < read + 1`), and no provisioning operation holds a
host lease (`create_revision = 0` over the lease prefix). Either everything applies or nothing does: a kill -9
before the request leaves the old state, after it the new. A transaction over etcd's `--max-txn-ops` (128 by
default) or `--max-request-bytes` (1.5 MiB) is refused by etcd whole, changing nothing; the error names the flag.

Keys a restore writes carry no etcd lease: a managed node's registration is adopted with a fresh lease by the
first gateway that probes it healthy (`qiip_core.discovery.EtcdRegistry.node_healthy`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from qiip_core._errors import RegistryUnavailable, StateConflict, StateError
from qiip_core.state._file import Snapshot
from qiip_core.state._kinds import KINDS
from qiip_core.storage import EtcdClient, b64, load_json_object, prefix_range_end, unb64

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["apply_etcd", "busy_hosts_etcd", "read_etcd"]

logger = logging.getLogger("qiip.state")


def _lease_prefix(settings: Settings) -> bytes:
    return settings.etcd.provisioning_prefix.rstrip("/").encode() + b"-leases/"


def _unavailable(exc: RegistryUnavailable) -> StateError:
    return StateError(f"The state in etcd cannot be used: {exc.message}")


def read_etcd(settings: Settings, client: EtcdClient | None = None) -> Snapshot:
    """Every kind's entries in etcd, at one revision. A value that does not validate is skipped with a warning.

    Raises:
        StateError: etcd cannot be read.
    """
    client = client or EtcdClient(settings.etcd)
    snapshot = Snapshot(backend="etcd", where=client.endpoint)
    revision: int | None = None
    try:
        for kind in KINDS:
            prefix = kind.etcd_prefix(settings.etcd)
            revision, kvs = client.range_prefix(prefix, revision=revision)
            for kv in kvs:
                key = unb64(kv["key"])
                key_id = key[len(prefix) :].decode(errors="replace")
                try:
                    value = load_json_object(unb64(kv.get("value", "")), max_value_bytes=settings.etcd.max_value_bytes)
                    item = kind.validate(kind.from_etcd(key_id, value))
                except (ValueError, ValidationError) as exc:
                    logger.warning("skipping the %s at %s: %s", kind.noun, key.decode("unicode_escape"), exc)
                    continue
                snapshot.entries[kind.name][key_id] = kind.canonical(item)
    except RegistryUnavailable as exc:
        raise _unavailable(exc) from exc
    snapshot.revision = revision
    return snapshot


def busy_hosts_etcd(settings: Settings, client: EtcdClient | None = None) -> list[str]:
    """The hosts whose provisioning lease key exists (an operation runs there, or its gateway died within the TTL).

    Raises:
        StateError: etcd cannot be read.
    """
    client = client or EtcdClient(settings.etcd)
    prefix = _lease_prefix(settings)
    try:
        _, kvs = client.range_prefix(prefix)
    except RegistryUnavailable as exc:
        raise _unavailable(exc) from exc
    return sorted(unb64(kv["key"])[len(prefix) :].decode(errors="replace") for kv in kvs)


def _operations(settings: Settings, current: Snapshot, incoming: Snapshot) -> list[dict[str, Any]]:
    operations: list[dict[str, Any]] = []
    for kind in KINDS:
        prefix = kind.etcd_prefix(settings.etcd)
        now, new = current.entries[kind.name], incoming.entries[kind.name]
        for item_id in sorted(set(now) - set(new)):
            operations.append({"request_delete_range": {"key": b64(prefix + item_id.encode())}})
        for item_id in sorted(new):
            if now.get(item_id) != new[item_id]:
                value = kind.etcd_value(new[item_id])
                operations.append({"request_put": {"key": b64(prefix + item_id.encode()), "value": b64(value)}})
    return operations


def apply_etcd(
    settings: Settings,
    client: EtcdClient,
    current: Snapshot,
    incoming: Snapshot,
    *,
    on_step: Callable[[str], None] | None = None,
) -> None:
    """Make etcd hold `incoming`'s entries, in one transaction guarded against any change since `current` was read.

    Args:
        settings: `[etcd]` (endpoints, prefixes).
        client: the client `current` was read with.
        current: etcd's state as read (`read_etcd`), its `revision` set.
        incoming: the state to hold.
        on_step: called with `planned` before the transaction and `committed` after it (for kill -9 tests).

    Raises:
        StateConflict: a key changed since `current` was read, or a host lease was taken; nothing changed.
        StateError: etcd refused or did not answer (a transaction over its limits included); nothing changed.
    """
    assert current.revision is not None
    operations = _operations(settings, current, incoming)
    step = on_step or (lambda _: None)
    step("planned")
    if not operations:
        step("committed")
        return
    compare: list[dict[str, Any]] = []
    for kind in KINDS:
        prefix = kind.etcd_prefix(settings.etcd)
        compare.append(
            {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix)), "target": "MOD", "result": "LESS",
             "mod_revision": current.revision + 1}
        )  # fmt: skip
    lease_prefix = _lease_prefix(settings)
    compare.append(
        {"key": b64(lease_prefix), "range_end": b64(prefix_range_end(lease_prefix)), "target": "CREATE",
         "result": "EQUAL", "create_revision": 0}
    )  # fmt: skip
    txn = {"compare": compare, "success": operations, "failure": []}
    try:
        result = client.call(lambda c: c.transaction(txn))
    except RegistryUnavailable as exc:
        if "too many operations" in exc.message or "too large" in exc.message:
            raise StateError(
                f"etcd refused the restore's transaction of {len(operations)} changes as over its limits "
                f"({exc.message}); start etcd with a larger --max-txn-ops (or --max-request-bytes) and run it "
                "again. Nothing was changed."
            ) from exc
        raise _unavailable(exc) from exc
    if not result.get("succeeded"):
        raise StateConflict(
            "The state in etcd changed while it was restored (another restore, a gateway's write, or a provisioning "
            "operation that started); nothing was changed. Run it again."
        )
    step("committed")

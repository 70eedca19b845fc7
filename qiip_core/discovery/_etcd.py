"""The etcd registry: several gateways, one view of the fleet.

Key schema (compatible with the seed system): `<prefix><node_id>` holds the node as JSON without its id.
Unknown fields are ignored; a missing `managed` means externally owned; a value that is malformed, too
large, names an unknown engine or an endpoint outside the allowlist is skipped with a warning, and a skip
is never treated as a delete.

The gateway follows the prefix with a `PrefixFollower` (snapshot, then a watch from the next revision,
per-key `mod_revision`, back to a snapshot after a compaction or an outage; see `qiip_core.storage`): it
keeps serving what it last knew while etcd cannot be reached, and `status()` reports the outage for `/health`.
Key/value, lease and transaction calls go through the storage package's `EtcdClient` (synchronous; run off
the event loop).

Managed nodes (the ones QIIP launched) carry a lease (`etcd.lease_ttl_s`). A gateway refreshes a node's
lease only after its own successful health probe of that node (`node_healthy`), so a node that nobody can
reach expires and leaves every gateway's routing. A managed key found without a lease is adopted: a
transaction re-writes it with a fresh lease only if its `mod_revision` and lease are still the ones seen.
Shutdown never revokes leases: the nodes keep serving through a gateway restart.

The fleet as last read from etcd is saved in the state directory (`LAST_KNOWN_FILE`, at most once a second, and at
each reconnection). A gateway that starts while etcd cannot be reached serves that saved fleet (its nodes probed
and routed as usual) and says so in `status()`, until etcd answers: the first snapshot then replaces it, keys gone
meanwhile leave, changed ones are updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from qiip_core._errors import EndpointError, NodeConflict, NodeNotFound, RegistryUnavailable
from qiip_core._violation import first_violation
from qiip_core.config import Settings
from qiip_core.discovery._base import (
    RegisteredNode,
    Registry,
    RegistryEvent,
    RegistryEventKind,
    RegistryHealth,
    RegistryStatus,
)
from qiip_core.discovery._embedded import check_free_id, config_nodes
from qiip_core.nodes import EndpointPolicy, Node, NodeStatus
from qiip_core.storage import EtcdClient, PrefixFollower, atomic_write, load_json_object, unb64

__all__ = ["LAST_KNOWN_FILE", "EtcdRegistry", "decode_node", "encode_node"]

logger = logging.getLogger("qiip.discovery")

LAST_KNOWN_FILE = "etcd-fleet.json"
"""The fleet as last read from etcd, in the state directory: what a gateway starting while etcd is down serves."""

_SAVE_EVERY_S = 1.0
"""The least time between two saves of the fleet (`LAST_KNOWN_FILE`)."""


def encode_node(node: Node) -> bytes:
    """The etcd value of a registration: the node as JSON, without its id (which is in the key)."""
    return json.dumps(node.model_dump(mode="json", exclude={"id"}), separators=(",", ":")).encode()


def decode_node(node_id: str, value: bytes, policy: EndpointPolicy, *, max_value_bytes: int) -> Node:
    """Parse an etcd value into a registration, endpoint checked.

    Raises:
        ValueError: the value is too large, not a JSON object, fails validation (an unknown engine, a
            missing field, a wrong type), or its endpoint is malformed or outside the allowlist.
    """
    data = load_json_object(value, max_value_bytes=max_value_bytes)
    data.pop("id", None)
    try:
        node = Node.model_validate({**data, "id": node_id})
        return node.model_copy(update={"endpoint": policy.check(node.endpoint).url})
    except ValidationError as exc:
        error = first_violation(exc)
        raise ValueError(f"{error.field}: {error.message}") from None
    except EndpointError as exc:
        raise ValueError(exc.message) from None


@dataclass(slots=True)
class _Seen:
    """What the gateway last applied for one key."""

    mod_revision: int
    lease: int
    node: Node | None
    """None when the current value was skipped as invalid."""


class EtcdRegistry(Registry):
    """Node registrations in etcd, shared by every gateway of the fleet.

    Args:
        settings: the daemon's settings (`[etcd]`, the allowlist, config nodes).

    Raises:
        ConfigError: a `[[nodes]]` endpoint of the config file is malformed or not allowed.
    """

    backend = "etcd"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.etcd = settings.etcd
        self.policy = settings.routing.endpoint_policy()
        self.client = EtcdClient(settings.etcd)
        self._prefix = settings.etcd.prefix.encode()
        self._config = config_nodes(settings, self.policy)
        self._seen: dict[str, _Seen] = {}
        self._on_event: Callable[[RegistryEvent], None] | None = None
        self._refresh_due: dict[str, float] = {}
        self._last_known_path = settings.state_dir / LAST_KNOWN_FILE
        # While serving the saved fleet: when it was saved, and the ids etcd has not confirmed yet.
        self._last_known_at: datetime | None = None
        self._unconfirmed: set[str] = set()
        self._following = False
        self._read_once = False
        self._changed = asyncio.Event()
        self._saver: asyncio.Task[None] | None = None
        self._follower = PrefixFollower(
            self.client,
            self._prefix,
            on_put=self._apply_put,
            on_delete=self._apply_delete,
            on_state=self._follower_state,
            label="etcd registry",
            outage="Serving the last known registrations",
            task_name="qiip-etcd-follow",
            log=logger,
        )

    # -- following etcd ------------------------------------------------------------------------------------

    async def start(self, on_event: Callable[[RegistryEvent], None]) -> None:
        self._on_event = on_event
        for node in self._config.values():
            on_event(RegistryEvent(RegistryEventKind.PUT, node.id, node, "config"))
        # Starts even while etcd is unreachable: the config's nodes serve with the saved fleet, and etcd's replace
        # it once it answers.
        await self._follower.start()
        self._saver = asyncio.create_task(self._save_every(), name="qiip-etcd-fleet-save")

    async def aclose(self) -> None:
        await self._follower.aclose()
        if self._saver is not None:
            self._saver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._saver
            if self._changed.is_set() and self._reading_etcd:
                await asyncio.to_thread(self._save, list(self._seen.items()), self._follower.revision)

    # -- the last known fleet ------------------------------------------------------------------------------

    def _follower_state(self, error: str | None) -> None:
        if error is None:
            if not self._following:
                # Connected (again): what etcd holds now is the fleet to save.
                self._following = self._read_once = True
                self._changed.set()
            if self._last_known_at is not None:
                gone = sorted(self._unconfirmed)
                self._last_known_at, self._unconfirmed = None, set()
                for node_id in gone:
                    self._apply_delete(node_id)
                logger.info(
                    "etcd registry: etcd answers; its fleet replaces the saved one (%d saved node(s) no longer "
                    "registered%s)",
                    len(gone),
                    f": {', '.join(gone)}" if gone else "",
                )
            return
        self._following = False
        if not self._read_once and self._last_known_at is None:
            self._read_once = True  # one try, at start
            self._serve_last_known(error)

    def _serve_last_known(self, error: str) -> None:
        """etcd cannot be read at start: serve the fleet saved when it last could (`LAST_KNOWN_FILE`)."""
        path = self._last_known_path
        try:
            data = load_json_object(path.read_bytes(), max_value_bytes=1 << 30)
            saved_at = datetime.fromisoformat(str(data["saved_at"]))
            if data.get("prefix") != self.etcd.prefix:
                raise ValueError(f"it holds the nodes of the prefix {data.get('prefix')!r}, not {self.etcd.prefix!r}")
            entries = list(data["nodes"])
        except FileNotFoundError:
            logger.warning("etcd registry: no fleet was saved (%s); serving the config file's nodes only", path)
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("etcd registry: the saved fleet in %s cannot be used (%s); serving none of it", path, exc)
            return
        served = 0
        for entry in entries:
            try:
                node_id = str(entry["id"])
                node = decode_node(
                    node_id, str(entry["value"]).encode(), self.policy, max_value_bytes=self.etcd.max_value_bytes
                )
                seen = _Seen(int(entry["mod_revision"]), int(entry["lease"]), node)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("etcd registry: skipping a saved node in %s: %s", path, exc)
                continue
            if node_id in self._config or node_id in self._seen:
                continue
            self._seen[node_id] = seen
            self._unconfirmed.add(node_id)
            self._emit(RegistryEvent(RegistryEventKind.PUT, node_id, node, "etcd"))
            served += 1
        self._last_known_at = saved_at
        logger.warning(
            "etcd registry: %s Serving the last known fleet until it answers: %d node(s), saved %s in %s",
            error,
            served,
            saved_at.isoformat(timespec="seconds"),
            path,
        )

    def _save(self, seen: list[tuple[str, _Seen]], revision: int) -> None:
        """Write `seen` (a copy of the view taken on the event loop; its nodes are immutable) to `LAST_KNOWN_FILE`;
        run off the loop."""
        nodes = [
            {"id": node_id, "mod_revision": s.mod_revision, "lease": s.lease, "value": encode_node(s.node).decode()}
            for node_id, s in sorted(seen, key=lambda item: item[0])
            if s.node is not None
        ]
        document = {
            "version": 1,
            "saved_at": datetime.now(UTC).isoformat(),
            "prefix": self.etcd.prefix,
            "revision": revision,
            "nodes": nodes,
        }
        try:
            atomic_write(self._last_known_path, json.dumps(document, separators=(",", ":")).encode())
        except OSError as exc:
            logger.warning("etcd registry: could not save the fleet in %s: %s", self._last_known_path, exc)

    async def _save_every(self) -> None:
        """Save the fleet as etcd gives it (never the saved one being served), at most every `_SAVE_EVERY_S`."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self._reading_etcd:
                await asyncio.to_thread(self._save, list(self._seen.items()), self._follower.revision)
            await asyncio.sleep(_SAVE_EVERY_S)

    @property
    def _reading_etcd(self) -> bool:
        """True while the fleet held is etcd's (not the saved one), so it may be saved."""
        return self._following and self._last_known_at is None

    def _apply_put(self, node_id: str, kv: dict[str, Any], mod_revision: int) -> None:
        if node_id in self._config:
            logger.warning("etcd registry: node %s is shadowed by a config node of that id", node_id)
            return
        lease = int(kv.get("lease", 0) or 0)
        try:
            node: Node | None = decode_node(
                node_id, unb64(kv.get("value", "")), self.policy, max_value_bytes=self.etcd.max_value_bytes
            )
        except ValueError as exc:
            logger.warning("etcd registry: skipping node %s at revision %d: %s", node_id, mod_revision, exc)
            node = None
        seen = self._seen.get(node_id)
        previous = seen.node if seen is not None else None
        self._seen[node_id] = _Seen(mod_revision, lease, node if node is not None else previous)
        self._unconfirmed.discard(node_id)
        self._changed.set()
        if node is not None and node != previous:
            self._emit(RegistryEvent(RegistryEventKind.PUT, node_id, node, "etcd"))

    def _apply_delete(self, node_id: str) -> None:
        seen = self._seen.pop(node_id, None)
        if seen is None:
            return
        self._changed.set()
        self._refresh_due.pop(node_id, None)
        if seen.node is not None:
            self._emit(RegistryEvent(RegistryEventKind.DELETE, node_id, None, "etcd"))

    def _emit(self, event: RegistryEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)

    # -- writes --------------------------------------------------------------------------------------------

    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        if node.id in self._config:
            raise NodeConflict(f"Node {node.id!r} is declared in the config file; change it there.")
        if not ephemeral:
            check_free_id(self.settings, node.id)
        stored = node.model_copy(update={"endpoint": self.policy.check(node.endpoint).url})
        ttl = self.etcd.lease_ttl_s if stored.managed else None
        await asyncio.to_thread(self.client.put, self._prefix + node.id.encode(), encode_node(stored), lease_ttl_s=ttl)
        return stored

    async def deregister(self, node_id: str) -> None:
        if node_id in self._config:
            raise NodeConflict(f"Node {node_id!r} is declared in the config file; remove it there and restart.")
        if not await asyncio.to_thread(self.client.delete, self._prefix + node_id.encode()):
            raise NodeNotFound(node_id)

    async def set_lifecycle(self, node_id: str, status: NodeStatus | None) -> None:
        if node_id in self._config:
            # A config node is this gateway's own: its lifecycle is too.
            config_node = self._config[node_id]
            if status is not None:
                config_node = config_node.model_copy(update={"status": status})
            self._emit(RegistryEvent(RegistryEventKind.PUT, node_id, config_node, "config"))
            return
        seen = self._seen.get(node_id)
        if seen is None or seen.node is None:
            raise NodeNotFound(node_id)
        node = seen.node.model_copy(update={"status": status or NodeStatus.UNKNOWN})
        await asyncio.to_thread(
            self.client.put_with_lease, self._prefix + node_id.encode(), encode_node(node), seen.lease
        )

    async def node_healthy(self, node_id: str) -> None:
        """Refresh (or adopt) the lease of a managed node this gateway just probed successfully."""
        seen = self._seen.get(node_id)
        if seen is None or seen.node is None or not seen.node.managed:
            return
        now = time.monotonic()
        if now < self._refresh_due.get(node_id, 0.0):
            return
        # Refresh at a third of the lease's granted TTL, as etcd's own keep-alive does.
        self._refresh_due[node_id] = now + self.etcd.lease_ttl_s / 3
        try:
            if seen.lease:
                ttl = await asyncio.to_thread(self.client.refresh, seen.lease)
                if ttl <= 0:
                    logger.warning("etcd registry: the lease of managed node %s has expired", node_id)
                else:
                    self._refresh_due[node_id] = now + ttl / 3
            else:
                adopted = await asyncio.to_thread(
                    self.client.adopt,
                    self._prefix + node_id.encode(),
                    encode_node(seen.node),
                    mod_revision=seen.mod_revision,
                    lease_ttl_s=self.etcd.lease_ttl_s,
                )
                verb = "adopted" if adopted else "did not adopt (it changed meanwhile)"
                logger.info("etcd registry: %s the unleased managed node %s", verb, node_id)
        except RegistryUnavailable as exc:
            logger.warning("etcd registry: could not refresh the lease of %s: %s", node_id, exc.message)

    # -- reading -------------------------------------------------------------------------------------------

    def nodes(self) -> list[RegisteredNode]:
        merged = [RegisteredNode(s.node, "etcd") for s in self._seen.values() if s.node is not None]
        merged += [RegisteredNode(n, "config") for n in self._config.values()]
        return sorted(merged, key=lambda r: r.node.id)

    def status(self) -> RegistryStatus:
        count = len(self._config) + sum(1 for s in self._seen.values() if s.node is not None)
        error = self._follower.error
        if error is not None and self._last_known_at is not None:
            detail = (
                f"{error} Serving the last known fleet ({len(self._seen)} node(s), saved "
                f"{self._last_known_at.isoformat(timespec='seconds')}) until etcd answers."
            )
            return RegistryStatus(self.backend, RegistryHealth.DEGRADED, detail, count, self._last_known_at)
        if error is not None:
            return RegistryStatus(self.backend, RegistryHealth.DEGRADED, error, count)
        return RegistryStatus(
            self.backend, RegistryHealth.OK, f"etcd {self.client.endpoint} at revision {self._follower.revision}", count
        )

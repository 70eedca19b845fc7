"""Registry changes from outside the daemon (`qiip node …`, `qiip registry status`), whatever the backend.

The embedded backend is changed through its state file, which a running daemon on the same state
directory follows; the etcd backend is changed in etcd, which every gateway watches. Either way the CLI
works the same whether or not a daemon runs.
"""

from __future__ import annotations

import logging

from qiip_core._errors import NodeConflict, NodeNotFound
from qiip_core.config import Settings
from qiip_core.discovery._base import RegisteredNode, RegistryHealth, RegistryStatus
from qiip_core.discovery._embedded import (
    add_to_state_file,
    check_free_id,
    config_nodes,
    list_registrations,
    remove_from_state_file,
)
from qiip_core.discovery._etcd import decode_node, encode_node
from qiip_core.discovery._statefile import StateFile
from qiip_core.nodes import Node, NodeStatus
from qiip_core.storage import EtcdClient, unb64

__all__ = ["add_registration", "list_all_registrations", "registry_status", "remove_registration"]

logger = logging.getLogger("qiip.discovery")


def add_registration(settings: Settings, node: Node, *, replace: bool = False) -> Node:
    """Register a node in the configured backend (what `qiip node add` does).

    Returns:
        The stored registration, endpoint normalised.

    Raises:
        EndpointError: the endpoint is malformed or outside the allowlist.
        NodeConflict: the id is the configuration's (`check_free_id`), or exists and `replace` is False.
        RegistryUnavailable: the backend cannot be read or written.
    """
    if settings.registry.backend == "embedded":
        return add_to_state_file(settings, node, replace=replace)
    policy = settings.routing.endpoint_policy()
    stored = node.model_copy(
        update={"endpoint": policy.check(node.endpoint).url, "status": NodeStatus.UNKNOWN, "last_heartbeat": None}
    )
    check_free_id(settings, node.id)
    client = EtcdClient(settings.etcd)
    key = settings.etcd.prefix.encode() + node.id.encode()
    if not replace and client.range_prefix(key)[1]:
        raise NodeConflict(f"Node {node.id!r} is already registered; remove it first or use --replace.")
    client.put(key, encode_node(stored), lease_ttl_s=settings.etcd.lease_ttl_s if stored.managed else None)
    return stored


def remove_registration(settings: Settings, node_id: str) -> None:
    """Remove a registration from the configured backend; gateways drain the node, then forget it.

    Raises:
        NodeConflict: the node is declared in the config file.
        NodeNotFound: no registration has this id.
        RegistryUnavailable: the backend cannot be written.
    """
    if settings.registry.backend == "embedded":
        remove_from_state_file(settings, node_id)
        return
    if any(item.id == node_id for item in settings.nodes):
        raise NodeConflict(f"Node {node_id!r} is declared in the config file; remove it there and restart.")
    if not EtcdClient(settings.etcd).delete(settings.etcd.prefix.encode() + node_id.encode()):
        raise NodeNotFound(node_id)


def list_all_registrations(settings: Settings) -> list[RegisteredNode]:
    """Every registration of the configured backend plus the config file's, sorted by id.

    Values in etcd that cannot be used (malformed, outside the allowlist) are left out with a warning.

    Raises:
        ConfigError: a config node is invalid.
        RegistryUnavailable: the backend cannot be read.
    """
    if settings.registry.backend == "embedded":
        return list_registrations(settings)
    policy = settings.routing.endpoint_policy()
    configured = config_nodes(settings, policy)
    prefix = settings.etcd.prefix.encode()
    entries = [RegisteredNode(n, "config") for n in configured.values()]
    for kv in EtcdClient(settings.etcd).range_prefix(prefix)[1]:
        node_id = unb64(kv["key"])[len(prefix) :].decode(errors="replace")
        if node_id in configured:
            continue
        try:
            node = decode_node(
                node_id, unb64(kv.get("value", "")), policy, max_value_bytes=settings.etcd.max_value_bytes
            )
        except ValueError as exc:
            logger.warning("skipping node %s in etcd: %s", node_id, exc)
            continue
        entries.append(RegisteredNode(node, "etcd"))
    return sorted(entries, key=lambda r: r.node.id)


def registry_status(settings: Settings) -> RegistryStatus:
    """Whether the configured backend can be read now, and how many registrations it holds."""
    try:
        count = len(list_all_registrations(settings))
    except Exception as exc:  # every failure is what the status reports
        message = getattr(exc, "message", str(exc))
        return RegistryStatus(settings.registry.backend, RegistryHealth.DEGRADED, message, 0)
    if settings.registry.backend == "embedded":
        detail = f"state file {StateFile(settings.state_dir).path}"
    else:
        client = EtcdClient(settings.etcd)
        revision = client.range_prefix(settings.etcd.prefix.encode())[0]
        detail = f"etcd {client.endpoint} at revision {revision}, prefix {settings.etcd.prefix}"
    return RegistryStatus(settings.registry.backend, RegistryHealth.OK, detail, count)

"""Discovery: where node registrations live (the embedded state file by default, etcd for a fleet).

`create_registry(settings)` picks the backend named by `registry.backend`.

The files and etcd plumbing underneath (`atomic_write`, `LockedJsonFile`, `EtcdClient`, `PrefixFollower`) are
`qiip_core.storage`'s, shared with the token store and the console; they are re-exported here, where they were
first published.
"""

from __future__ import annotations

from qiip_core.discovery._admin import (
    add_registration,
    list_all_registrations,
    registry_status,
    remove_registration,
)
from qiip_core.discovery._attached import MAX_TOKEN_FILE_BYTES, attached_node, read_token_file
from qiip_core.discovery._base import (
    RegisteredNode,
    Registry,
    RegistryEvent,
    RegistryEventKind,
    RegistryHealth,
    RegistryStatus,
)
from qiip_core.discovery._embedded import (
    EmbeddedRegistry,
    add_to_state_file,
    check_free_id,
    config_nodes,
    list_registrations,
    remove_from_state_file,
)
from qiip_core.discovery._etcd import LAST_KNOWN_FILE, EtcdRegistry, decode_node, encode_node
from qiip_core.discovery._factory import create_registry
from qiip_core.discovery._statefile import STATE_FILE_NAME, StateFile

# The storage primitives were first written here; they stay importable from here.
from qiip_core.storage import EtcdClient, LockedJsonFile, PrefixFollower, atomic_write

__all__ = [
    "LAST_KNOWN_FILE",
    "MAX_TOKEN_FILE_BYTES",
    "STATE_FILE_NAME",
    "EmbeddedRegistry",
    "EtcdClient",
    "EtcdRegistry",
    "LockedJsonFile",
    "PrefixFollower",
    "RegisteredNode",
    "Registry",
    "RegistryEvent",
    "RegistryEventKind",
    "RegistryHealth",
    "RegistryStatus",
    "StateFile",
    "add_registration",
    "add_to_state_file",
    "atomic_write",
    "attached_node",
    "check_free_id",
    "config_nodes",
    "create_registry",
    "decode_node",
    "encode_node",
    "list_all_registrations",
    "list_registrations",
    "read_token_file",
    "registry_status",
    "remove_from_state_file",
    "remove_registration",
]

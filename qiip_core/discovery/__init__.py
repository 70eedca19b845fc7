"""Discovery: where node registrations live (the embedded state file by default, etcd for a fleet)."""

from __future__ import annotations

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
    config_nodes,
    list_registrations,
    remove_from_state_file,
)
from qiip_core.discovery._statefile import STATE_FILE_NAME, StateFile, atomic_write

__all__ = [
    "STATE_FILE_NAME",
    "EmbeddedRegistry",
    "RegisteredNode",
    "Registry",
    "RegistryEvent",
    "RegistryEventKind",
    "RegistryHealth",
    "RegistryStatus",
    "StateFile",
    "add_to_state_file",
    "atomic_write",
    "config_nodes",
    "list_registrations",
    "remove_from_state_file",
]

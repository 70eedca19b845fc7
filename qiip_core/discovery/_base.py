"""The registry interface: where the fleet's node registrations live.

A registry holds registrations (`Node` records) and tells the daemon about every change through the
`on_event` callback given to `start()`; the daemon applies them to its routing table. Two backends
implement it: the embedded one (a state file, the default) and etcd (several gateways, one fleet).
Routing code only ever sees `RegistryEvent`s, so it does not change with the backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from qiip_core.nodes import Node, NodeStatus

__all__ = [
    "RegisteredNode",
    "Registry",
    "RegistryEvent",
    "RegistryEventKind",
    "RegistryHealth",
    "RegistryStatus",
]


class RegistryEventKind(StrEnum):
    """What happened to a registration."""

    PUT = "put"
    """Added or changed."""
    DELETE = "delete"
    """Removed."""


@dataclass(frozen=True, slots=True)
class RegistryEvent:
    """One change of the registry.

    Attributes:
        kind: put or delete.
        node_id: the node's id.
        node: the new registration (None for a delete).
        source: where it comes from (`config`, `state`, `local`, `etcd`).
    """

    kind: RegistryEventKind
    node_id: str
    node: Node | None
    source: str


@dataclass(frozen=True, slots=True)
class RegisteredNode:
    """A registration with its source, as `qiip node list` shows it."""

    node: Node
    source: str


class RegistryHealth(StrEnum):
    """Whether the registry's backend is reachable."""

    OK = "ok"
    """Reads and writes work."""
    DEGRADED = "degraded"
    """Serving from the last known state; the backend is failing (details in `RegistryStatus.detail`)."""


@dataclass(frozen=True, slots=True)
class RegistryStatus:
    """The registry's state for `/health` and `qiip registry status`.

    Attributes:
        backend: `embedded` or `etcd`.
        health: ok or degraded.
        detail: a sentence for operators (where the state lives, or what fails).
        nodes: registrations known.
        last_known_at: while the backend could not be read since the daemon started, when the fleet it serves
            instead was saved (etcd: `<state_dir>/etcd-fleet.json`); None otherwise.
    """

    backend: str
    health: RegistryHealth
    detail: str
    nodes: int
    last_known_at: datetime | None = None


class Registry(ABC):
    """Where node registrations live. Implementations: `EmbeddedRegistry`, the etcd registry."""

    backend: str = "abstract"

    @abstractmethod
    async def start(self, on_event: Callable[[RegistryEvent], None]) -> None:
        """Load the current registrations, report each as a PUT, then keep reporting changes.

        Args:
            on_event: called on the event loop for every change, in order.
        """

    @abstractmethod
    async def aclose(self) -> None:
        """Stop watching. Registrations stay where they are."""

    @abstractmethod
    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        """Add or replace a runtime registration.

        Args:
            node: the registration; its endpoint is checked against the allowlist.
            ephemeral: True for a node this daemon launched itself: it is not kept across restarts.

        Returns:
            The stored registration (endpoint normalised).

        Raises:
            EndpointError: the endpoint is malformed or not allowed.
            NodeConflict: the id belongs to a node from the config file.
            RegistryUnavailable: the backend cannot be written.
        """

    @abstractmethod
    async def deregister(self, node_id: str) -> None:
        """Remove a runtime registration.

        Raises:
            NodeNotFound: no runtime registration has this id.
            NodeConflict: the node comes from the config file.
            RegistryUnavailable: the backend cannot be written.
        """

    @abstractmethod
    def nodes(self) -> list[RegisteredNode]:
        """Every registration known now, sorted by id."""

    @abstractmethod
    def status(self) -> RegistryStatus:
        """The backend's state."""

    @abstractmethod
    async def set_lifecycle(self, node_id: str, status: NodeStatus | None) -> None:
        """Put a node into a lifecycle status (draining, relaunching, …) or take it out (None), for every
        gateway that shares this registry.

        Raises:
            NodeNotFound: no node has this id.
            RegistryUnavailable: the backend cannot be written.
        """

    async def node_healthy(self, node_id: str) -> None:
        """This gateway's health probe of `node_id` just succeeded (etcd refreshes the node's lease)."""
        return None

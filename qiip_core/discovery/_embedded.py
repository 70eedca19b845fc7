"""The embedded registry: nodes from the config file, from the state file, and launched by this daemon.

Three sources, by precedence:

- `config`: `[[nodes]]` in the TOML file; read-only at run time (edit the file and restart);
- `local`: llama.cpp nodes this daemon launched itself; not persisted, relaunched on start;
- `state`: runtime registrations (`qiip node add`, the admin API), kept in the state file.

`qiip node add/remove` write the state file directly; a running daemon notices the change within
`registry.poll_interval_s` (it compares the file's mtime, size and inode) and applies the difference, so
the CLI works the same whether or not a daemon is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from qiip_core._errors import ConfigError, EndpointError, NodeConflict, NodeNotFound, RegistryUnavailable
from qiip_core.config import NodeConfig, Settings
from qiip_core.discovery._base import (
    RegisteredNode,
    Registry,
    RegistryEvent,
    RegistryEventKind,
    RegistryHealth,
    RegistryStatus,
)
from qiip_core.discovery._statefile import StateFile
from qiip_core.nodes import EndpointPolicy, Node, NodeStatus

__all__ = [
    "EmbeddedRegistry",
    "add_to_state_file",
    "config_nodes",
    "list_registrations",
    "remove_from_state_file",
]

logger = logging.getLogger("qiip.discovery")


def check_free_id(settings: Settings, node_id: str) -> None:
    """Refuse a registration id the configuration owns: a `[[nodes]]` or `[[local_nodes]]` id, or the name of
    an `[[attached]]` profile (its bearer token follows that name to the profile's URL only, and a node
    registered under it must never stand in for the profile).

    Raises:
        NodeConflict: the id is taken by the configuration.
    """
    if any(item.id == node_id for item in settings.nodes):
        raise NodeConflict(f"Node {node_id!r} is declared in the config file; change it there.")
    if any(item.id == node_id for item in settings.local_nodes):
        raise NodeConflict(f"Node {node_id!r} is a local node of the config file; choose another id.")
    if any(profile.name == node_id for profile in settings.attached):
        raise NodeConflict(f"Node id {node_id!r} is reserved for the attached profile of that name; choose another id.")


def config_nodes(settings: Settings, policy: EndpointPolicy) -> dict[str, Node]:
    """The `[[nodes]]` of the settings as registrations, endpoints checked.

    Raises:
        ConfigError: an endpoint is malformed or outside the allowlist (start-up stops).
    """
    nodes: dict[str, Node] = {}
    for index, item in enumerate(settings.nodes):
        nodes[item.id] = _from_config(item, policy, index)
    return nodes


def _from_config(item: NodeConfig, policy: EndpointPolicy, index: int) -> Node:
    try:
        endpoint = policy.check(item.endpoint).url
    except EndpointError as exc:
        raise ConfigError(f"Invalid setting nodes.{index}.endpoint (node {item.id!r}): {exc.message}") from exc
    return Node(
        id=item.id,
        endpoint=endpoint,
        model=item.model,
        engine=item.engine,
        capabilities=item.capabilities,
        status=NodeStatus.UNKNOWN,
    )


def add_to_state_file(settings: Settings, node: Node, *, replace: bool = False) -> Node:
    """Add a runtime registration to the state file (what `qiip node add` does).

    Args:
        settings: for the state directory, the allowlist and the config nodes.
        node: the registration; its status is stored as `unknown` (liveness is observed, not declared).
        replace: replace an existing registration with the same id instead of refusing.

    Returns:
        The stored registration, endpoint normalised.

    Raises:
        EndpointError: the endpoint is malformed or outside the allowlist.
        NodeConflict: the id is the configuration's (`check_free_id`), or exists and `replace` is False.
        RegistryUnavailable: the state file cannot be read or written.
    """
    policy = settings.routing.endpoint_policy()
    endpoint = policy.check(node.endpoint).url
    check_free_id(settings, node.id)
    stored = node.model_copy(update={"endpoint": endpoint, "status": NodeStatus.UNKNOWN, "last_heartbeat": None})

    def change(nodes: dict[str, Node]) -> dict[str, Node]:
        if node.id in nodes and not replace:
            raise NodeConflict(f"Node {node.id!r} is already registered; remove it first or use --replace.")
        return {**nodes, node.id: stored}

    StateFile(settings.state_dir).update(change)
    return stored


def remove_from_state_file(settings: Settings, node_id: str) -> Node:
    """Remove a runtime registration from the state file (what `qiip node remove` does).

    Returns:
        The removed registration.

    Raises:
        NodeConflict: the node is declared in the config file.
        NodeNotFound: no runtime registration has this id.
        RegistryUnavailable: the state file cannot be read or written.
    """
    if any(item.id == node_id for item in settings.nodes):
        raise NodeConflict(f"Node {node_id!r} is declared in the config file; remove it there and restart.")
    removed: list[Node] = []

    def change(nodes: dict[str, Node]) -> dict[str, Node]:
        if node_id not in nodes:
            raise NodeNotFound(node_id)
        removed.append(nodes[node_id])
        return {k: v for k, v in nodes.items() if k != node_id}

    StateFile(settings.state_dir).update(change)
    return removed[0]


def list_registrations(settings: Settings) -> list[RegisteredNode]:
    """Registrations from the config file and the state file, sorted by id (what `qiip node list` shows).

    Raises:
        ConfigError: a config node is invalid.
        RegistryUnavailable: the state file cannot be read.
    """
    configured = config_nodes(settings, settings.routing.endpoint_policy())
    entries = [RegisteredNode(n, "config") for n in configured.values()]
    entries += [
        RegisteredNode(n, "state") for k, n in StateFile(settings.state_dir).read().items() if k not in configured
    ]
    return sorted(entries, key=lambda r: r.node.id)


class EmbeddedRegistry(Registry):
    """The default registry: config file + state file + nodes this daemon launched.

    Args:
        settings: the daemon's settings.

    Raises:
        ConfigError: a `[[nodes]]` endpoint is malformed or not allowed.
    """

    backend = "embedded"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.policy = settings.routing.endpoint_policy()
        self._config = config_nodes(settings, self.policy)
        self._local: dict[str, Node] = {}
        self._state: dict[str, Node] = {}
        # Lifecycle statuses set through the admin API (drains, relaunches); held in memory: a restart of
        # the daemon ends them.
        self._lifecycle: dict[str, NodeStatus] = {}
        self._state_file = StateFile(settings.state_dir)
        self._signature: tuple[int, int, int] | None = None
        self._on_event: Callable[[RegistryEvent], None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._error: str | None = None

    async def start(self, on_event: Callable[[RegistryEvent], None]) -> None:
        self._on_event = on_event
        for node in self._config.values():
            on_event(RegistryEvent(RegistryEventKind.PUT, node.id, node, "config"))
        await self._reload()
        self._poll_task = asyncio.create_task(self._poll(), name="qiip-registry-poll")

    async def aclose(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.registry.poll_interval_s)
            if self._state_file.signature() != self._signature:
                await self._reload()

    async def _reload(self) -> None:
        signature = self._state_file.signature()
        try:
            raw = await asyncio.to_thread(self._state_file.read)
        except RegistryUnavailable as exc:
            if self._error != exc.message:
                logger.error("%s Serving the last known registrations.", exc.message)
            self._error = exc.message
            self._signature = signature
            return
        if self._error is not None:
            logger.info("the state file %s is readable again", self._state_file.path)
            self._error = None
        self._signature = signature
        fresh: dict[str, Node] = {}
        for node_id, node in raw.items():
            if node_id in self._config or node_id in self._local:
                logger.warning("state file node %s is shadowed by a config or local node of that id", node_id)
                continue
            try:
                endpoint = self.policy.check(node.endpoint).url
            except EndpointError as exc:
                logger.warning("ignoring registered node %s: %s", node_id, exc.message)
                continue
            fresh[node_id] = node.model_copy(update={"endpoint": endpoint})
        old, self._state = self._state, fresh
        for node_id, node in fresh.items():
            if old.get(node_id) != node:
                self._emit(RegistryEvent(RegistryEventKind.PUT, node_id, node, "state"))
        for node_id in old.keys() - fresh.keys():
            if node_id in self._config or node_id in self._local:
                continue  # shadowed since: the node of that id is the config's or local one, and stays
            self._emit(RegistryEvent(RegistryEventKind.DELETE, node_id, None, "state"))

    def _emit(self, event: RegistryEvent) -> None:
        if self._on_event is None:
            return
        status = self._lifecycle.get(event.node_id)
        if event.node is not None and status is not None:
            event = RegistryEvent(
                event.kind, event.node_id, event.node.model_copy(update={"status": status}), event.source
            )
        self._on_event(event)

    def _current(self, node_id: str) -> tuple[Node, str] | None:
        for source, nodes in (("config", self._config), ("local", self._local), ("state", self._state)):
            if node_id in nodes:
                return nodes[node_id], source
        return None

    async def set_lifecycle(self, node_id: str, status: NodeStatus | None) -> None:
        current = self._current(node_id)
        if current is None:
            raise NodeNotFound(node_id)
        if status is None:
            self._lifecycle.pop(node_id, None)
        else:
            self._lifecycle[node_id] = status
        node, source = current
        self._emit(RegistryEvent(RegistryEventKind.PUT, node_id, node, source))

    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        if node.id in self._config:
            raise NodeConflict(f"Node {node.id!r} is declared in the config file; change it there.")
        self._lifecycle.pop(node.id, None)
        if ephemeral:
            stored = node.model_copy(update={"endpoint": self.policy.check(node.endpoint).url})
            if self._state.pop(node.id, None) is not None:
                logger.warning("state file node %s is shadowed by the local node of that id", node.id)
            self._local[node.id] = stored
            self._emit(RegistryEvent(RegistryEventKind.PUT, node.id, stored, "local"))
            return stored
        stored = await asyncio.to_thread(add_to_state_file, self.settings, node, replace=True)
        await self._reload()
        return stored

    async def deregister(self, node_id: str) -> None:
        self._lifecycle.pop(node_id, None)
        if node_id in self._local:
            del self._local[node_id]
            self._emit(RegistryEvent(RegistryEventKind.DELETE, node_id, None, "local"))
            return
        await asyncio.to_thread(remove_from_state_file, self.settings, node_id)
        await self._reload()

    def nodes(self) -> list[RegisteredNode]:
        merged = [RegisteredNode(n, "state") for n in self._state.values()]
        merged += [RegisteredNode(n, "local") for n in self._local.values()]
        merged += [RegisteredNode(n, "config") for n in self._config.values()]
        return sorted(merged, key=lambda r: r.node.id)

    def status(self) -> RegistryStatus:
        count = len(self._config) + len(self._local) + len(self._state)
        if self._error is not None:
            return RegistryStatus(self.backend, RegistryHealth.DEGRADED, self._error, count)
        return RegistryStatus(self.backend, RegistryHealth.OK, f"state file {self._state_file.path}", count)

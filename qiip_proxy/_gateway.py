"""The daemon's runtime: the registry feeds the routing table, the health checker observes it, the
forwarder sends client requests through it, and local llama.cpp nodes are launched beside it.

`Gateway.startup()` and `Gateway.shutdown()` are the stages the app's lifespan runs. Start-up never waits
for a node: the daemon serves (and answers `/health`) at once, and nodes become routable as their first
health probe succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qiip_core import NodeNotFound, QiipError
from qiip_core.auth import AuthThrottle, TokenStore, create_token_store
from qiip_core.catalog import DownloadManager, default_cache_dir, model_store_for
from qiip_core.config import Settings
from qiip_core.deployments import (
    DemandMeter,
    DeploymentService,
    FleetObserver,
    ProvisioningActuator,
    create_demand_exchange,
    create_deployment_store,
    create_leadership,
)
from qiip_core.discovery import (
    Registry,
    RegistryEvent,
    RegistryEventKind,
    attached_node,
    create_registry,
    read_token_file,
)
from qiip_core.engines.llamacpp import LocalNodeHandoff
from qiip_core.health import HealthChecker
from qiip_core.journal import Journal
from qiip_core.lifecycle import OperationRunner
from qiip_core.nodes import Node, NodeStatus
from qiip_core.provisioning import Provisioner, gateway_owner
from qiip_core.quads import QuadsService
from qiip_core.recommendations import Recommender
from qiip_core.routing import (
    Admission,
    BreakerPolicy,
    ColumnMap,
    Forwarder,
    InFlightBoard,
    NodeState,
    PrefixAffinity,
    RoutingPolicy,
    RoutingTable,
)
from qiip_core.telemetry import TelemetrySource, TelemetryStore, create_telemetry_source
from qiip_proxy._deployment_metrics import DeploymentCollector
from qiip_proxy._gpu_metrics import GpuCollector
from qiip_proxy._local_nodes import LocalNodes
from qiip_proxy._metrics import GatewayMetrics
from qiip_proxy._workers import WorkerPool, WorkerSpec

__all__ = ["AttachedTokens", "Gateway", "auth_throttle", "forwarder_for", "routing_table", "sweep_removed"]

logger = logging.getLogger("qiip.proxy")


class Gateway:
    """Everything one daemon runs, wired together, in its primary process (a worker serves with
    `_worker.WorkerGateway`).

    Args:
        settings: the validated settings.
        board: the board counting requests in flight over every serving process (`server.workers`); None:
            this process serves alone.
        workers: the worker processes this primary runs beside itself (`server.workers` above 1; `board` is then
            theirs); None: none.
        handoff: the local nodes `qiip up` planned (`LocalNodes`); None for a daemon started otherwise.

    Raises:
        ConfigError: a configured node is invalid, the admin API is enabled without credentials, or an attached
            profile's (or a telemetry agent's) token file is not private.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        board: InFlightBoard | None = None,
        workers: WorkerSpec | None = None,
        handoff: LocalNodeHandoff | None = None,
    ) -> None:
        settings.admin.check_credentials()
        self.settings = settings
        self.table = routing_table(settings, board=board, primary=True)
        self.admission = Admission(self.table, settings.admission)
        """The per-model bound on requests in flight (`[admission]`): past it, requests are shed."""
        self.registry: Registry = create_registry(settings)
        self.profiles = {profile.name: profile for profile in settings.attached}
        self.attached_tokens = AttachedTokens(settings, self.table)
        self.forwarder = forwarder_for(settings, self.table, self.attached_tokens.headers_for)
        self.health = HealthChecker(
            self.table,
            settings.health,
            on_healthy=self._node_healthy,
            headers_for=self.attached_tokens.headers_for,
            policy=settings.routing.endpoint_policy(),
        )
        self.fleet = _Fleet(self)
        self.demand_meter = DemandMeter()
        """What this process measures of each model's traffic for the autoscaler (in the primary: every process's
        finished requests and waiting ones)."""
        self.metrics = GatewayMetrics(self.table, on_finished=self.demand_meter.finished)
        self.telemetry = TelemetryStore(
            expire_after_intervals=settings.telemetry.expire_after_intervals,
            # Polled agents' readings are renewed once a poll at most; etcd pushes each as it is published.
            min_interval_s=settings.telemetry.interval_s if settings.registry.backend != "etcd" else 0.0,
        )
        """The latest live GPU reading of each node (`qiip agent`), for the admin API and `/metrics`."""
        self.telemetry_source: TelemetrySource = create_telemetry_source(settings, self.telemetry)
        self.metrics.registry.register(GpuCollector(self.telemetry))
        # Failed authentications per client address, one throttle per credential (so guessing one never locks
        # the other out): 429 past a burst.
        self.admin_throttle = auth_throttle(settings)
        """Wrong admin credentials per client address."""
        self.client_throttle = auth_throttle(settings)
        """Wrong invoke tokens per client address."""
        self.parse_gate = asyncio.Semaphore(1)
        """Held while a large request body is measured and parsed: such bodies take the event loop one at a time
        (`_parse.read_request`)."""
        self.local_nodes = LocalNodes(settings, self.registry, table=self.table, handoff=handoff)
        self.operations = OperationRunner()
        self.journal = Journal(self.table, self.operations)
        """The fleet's timeline: node changes with their reasons, and operations (the last 2,000 entries)."""
        self.cache_dir = settings.models.hf_cache_dir or default_cache_dir()
        """The Hugging Face cache the catalog reads and downloads fill."""
        self.downloads = DownloadManager(settings.models, self.cache_dir)
        self.model_store = model_store_for(settings)
        # Manifest acquisitions running in the background, by revision id.
        self.acquisitions: dict[str, asyncio.Task[None]] = {}
        self.provisioner = Provisioner(settings, self.fleet, self.table, self.operations)
        self.recommender = Recommender(
            settings, check_host=self.provisioner.check_host, known_hosts=self.provisioner.known_hosts
        )
        """llmfit's recommendations of hosts, over the provisioning SSH settings."""
        self.quads: QuadsService | None = (
            QuadsService(
                settings.quads,
                self.provisioner,
                self.table,
                networks=settings.routing.endpoint_policy().networks,
            )
            if settings.quads.enabled
            else None
        )
        """The QUADS scheduler's hosts, reservations and schedule enforcement (`[quads]`); None without it."""
        deployment_store = create_deployment_store(settings)
        self.deployments = DeploymentService(
            settings,
            store=deployment_store,
            observer=FleetObserver(
                settings,
                store=deployment_store,
                table=self.table,
                provisioner=self.provisioner,
                quads=lambda: self.quads.poller.snapshot if self.quads is not None else None,
                telemetry=self.telemetry,
            ),
            actuator=ProvisioningActuator(self.provisioner, self.fleet),
            leadership=create_leadership(settings, gateway_owner(settings)),
            models_in_use=self._models_without_deployment,
            table=self.table,
            meter=self.demand_meter,
            exchange=create_demand_exchange(settings, gateway_owner(settings)),
        )
        """Deployments: their records, the host pool, and the controller that keeps their replicas (`[deployments]`;
        it runs in the primary process, and with etcd in the one gateway that leads)."""
        self.metrics.registry.register(DeploymentCollector(self.deployments.seen))
        self.tokens: TokenStore = create_token_store(settings)
        # Streams running on each invoke token, ended at once when the token is revoked or expires.
        self.streams_by_token: dict[str, set[Callable[[], None]]] = {}
        # Endless streams (admin events), ended when the server begins to shut down.
        self.on_shutdown_begun: set[Callable[[], None]] = set()
        self.shutting_down = False
        self.workers = WorkerPool(self, workers) if workers is not None else None
        """The worker processes serving beside this one (`server.workers`), started with the gateway; None when
        this process serves alone."""
        self._sweep: asyncio.Task[None] | None = None

    def begin_shutdown(self) -> None:
        """The server stopped accepting connections and waits for the open ones: end the streams that never
        end by themselves (admin events), so the wait is for requests only. Call on the event loop."""
        if self.shutting_down:
            return
        self.shutting_down = True
        if self.workers is not None:
            self.workers.begin_shutdown()
        self.journal.close()
        for end in list(self.on_shutdown_begun):
            end()

    def force_shutdown(self) -> None:
        """The stop was forced (a second SIGINT during the grace): force the workers' stop too. Call on the event
        loop."""
        if self.workers is not None:
            self.workers.force_shutdown()

    def _models_without_deployment(self) -> dict[str, list[str]]:
        """The models nodes serve that no deployment owns, with those nodes' ids."""
        found: dict[str, list[str]] = {}
        for state in self.table:
            node = state.effective_node()
            if node.deployment is None and not state.removed:
                found.setdefault(node.model, []).append(node.id)
        return found

    def quads_view(self, node_id: str) -> dict[str, Any] | None:
        """The `quads` key of a node's view: what QUADS says of its host (None without QUADS, or for a host QUADS
        does not lend)."""
        return self.quads.host_view(node_id) if self.quads is not None else None

    def wake_controller(self) -> None:
        """A request waits for a deployment's first replica: have the deployment controller look now."""
        self.deployments.controller.wake()

    def attach(self, name: str) -> Node:
        """Attach the approved profile `name` as a node (re-reading its token file).

        Raises:
            NodeNotFound: no profile has this name.
            ConfigError: its token file is not a private regular file.
        """
        profile = self.profiles.get(name)
        if profile is None:
            raise NodeNotFound(name)
        if profile.token_file is not None:
            self.attached_tokens.reload(name, profile.token_file)
        node = attached_node(profile)
        logger.info("attached %s: %s serving %r", name, node.endpoint, node.model)
        self.table.apply_put(node, source="attached")
        return node

    async def _node_healthy(self, state: NodeState) -> None:
        await self.registry.node_healthy(state.id)

    def _apply(self, event: RegistryEvent) -> None:
        if event.node_id in self.profiles:
            # An attached profile's name, from a registry (written by another gateway, or by hand): it must
            # never stand in for the profile's node.
            logger.warning(
                "node %s from %s ignored: the id is reserved for the attached profile of that name",
                event.node_id,
                event.source,
            )
            return
        if event.kind is RegistryEventKind.PUT and event.node is not None:
            node = event.node
            verb = "updated" if event.node_id in self.table else "registered"
            logger.info(
                "node %s %s from %s: %s serving %r (%s)",
                node.id,
                verb,
                event.source,
                node.endpoint,
                node.model,
                node.engine.value,
            )
            self.table.apply_put(node, source=event.source)
        elif event.kind is RegistryEventKind.DELETE:
            state = self.table.get(event.node_id)
            in_flight = state.in_flight if state is not None else 0
            logger.info(
                "node %s deregistered from %s; %s",
                event.node_id,
                event.source,
                f"draining {in_flight} request(s) in flight" if in_flight else "removed",
            )
            self.table.apply_delete(event.node_id)

    @property
    def tokens_required(self) -> bool:
        """True when clients must present an invoke token (`auth.client_tokens = "required"`)."""
        return self.settings.auth.client_tokens == "required"

    def _token_revoked(self, token_id: str) -> None:
        for end in list(self.streams_by_token.pop(token_id, ())):
            end()

    async def startup(self) -> None:
        """Load the registry into the table, start health checks and the token store, mark provisioning tasks a
        crashed gateway left running as failed, launch local nodes (in the background)."""
        await self.tokens.start(self._token_revoked)
        self.health.start()
        for profile in self.settings.attached:
            if profile.attach_on_start:
                self.attach(profile.name)
        await self.registry.start(self._apply)
        await self.telemetry_source.start()
        try:
            await self.provisioner.recover()
        except QiipError as exc:
            logger.error("interrupted provisioning tasks could not be checked: %s", exc.message)
        self.local_nodes.start()
        if self.quads is not None:
            self.quads.start()
        self.deployments.start()
        if self.table.board is not None:
            self._sweep = asyncio.create_task(sweep_removed(self.table), name="qiip-sweep")
        if self.workers is not None:
            await self.workers.start()
        logger.info("gateway started: %d node(s) registered, registry %s", len(self.table), self.registry.backend)

    async def shutdown(self) -> None:
        """Stop the workers, local nodes, health checks and the registry watch; close upstream connections."""
        if self.workers is not None:
            await self.workers.aclose()
        if self._sweep is not None:
            self._sweep.cancel()
        await self.operations.aclose()
        await self.downloads.aclose()
        for revision_id, task in self.acquisitions.items():
            if not task.done():
                await asyncio.to_thread(self.model_store.pause, revision_id)
        await asyncio.gather(*self.acquisitions.values(), return_exceptions=True)
        await self.deployments.aclose()
        if self.quads is not None:
            await self.quads.aclose()
        await self.provisioner.aclose()
        await self.local_nodes.aclose()
        await self.health.aclose()
        await self.telemetry_source.aclose()
        await self.registry.aclose()
        await self.tokens.aclose()
        await self.forwarder.aclose()
        logger.info("gateway stopped")


def routing_table(settings: Settings, *, board: InFlightBoard | None, primary: bool) -> RoutingTable:
    """A serving process's routing table for `settings`: its breakers (`[breaker]`), prefix affinity (`[routing]`)
    and, with workers, the shared board (`board`; the primary assigns its columns)."""
    breaker, routing = settings.breaker, settings.routing
    return RoutingTable(
        breaker=BreakerPolicy(
            min_failures=breaker.failure_threshold,
            failure_rate=breaker.failure_rate,
            window_s=breaker.window_s,
            open_s=breaker.open_s,
            open_max_s=breaker.open_max_s,
        ),
        probe_interval_s=settings.health.interval_s,
        affinity=PrefixAffinity(
            policy=RoutingPolicy(routing.policy),
            model_policy={model: RoutingPolicy(policy) for model, policy in routing.model_policy.items()},
            max_entries=routing.prefix_cache_entries,
            ttl_s=routing.prefix_ttl_s,
            imbalance_requests=routing.prefix_imbalance_requests,
            imbalance_ratio=routing.prefix_imbalance_ratio,
        ),
        board=board,
        columns=ColumnMap(board.columns) if board is not None and primary else None,
    )


def forwarder_for(settings: Settings, table: RoutingTable, headers_for: Callable[[str], dict[str, str]]) -> Forwarder:
    """A serving process's forwarder over `table` (`[upstream]`, `[routing]`), sending `headers_for(node_id)` with
    each attempt (`AttachedTokens.headers_for`)."""
    return Forwarder(
        table,
        settings.upstream,
        max_attempts=settings.routing.max_attempts,
        retry_after_timeout=settings.routing.retry_after_timeout,
        headers_for=headers_for,
        policy=settings.routing.endpoint_policy(),
    )


def auth_throttle(settings: Settings) -> AuthThrottle:
    """A throttle of failed authentications per client address (`admin.auth_failure_burst` within
    `admin.auth_failure_window_s`): 429 past the burst."""
    return AuthThrottle(burst=settings.admin.auth_failure_burst, window_s=settings.admin.auth_failure_window_s)


class AttachedTokens:
    """The bearer tokens of attached servers (`[[attached]]` with `token_file`): sent to them only, never shown.

    Args:
        settings: the attached profiles.
        table: the routing table, where an attached node is told from another of its id.

    Raises:
        ConfigError: a token file is not a private regular file.
    """

    def __init__(self, settings: Settings, table: RoutingTable) -> None:
        self._table = table
        # Where each profile's token may go: its own URL, as its node carries it.
        self._urls = {profile.name: attached_node(profile).endpoint for profile in settings.attached}
        self._tokens = {
            p.name: read_token_file(p.token_file, profile=p.name) for p in settings.attached if p.token_file
        }

    def reload(self, name: str, token_file: Path) -> None:
        """Read the profile `name`'s token file again.

        Raises:
            ConfigError: it is not a private regular file.
        """
        self._tokens[name] = read_token_file(token_file, profile=name)

    def headers_for(self, node_id: str) -> dict[str, str]:
        """The bearer token of an attached profile, for requests to that profile's node: only while the node
        of that id is the attached one at the profile's own URL, so a token never follows a name elsewhere."""
        token = self._tokens.get(node_id)
        if not token:
            return {}
        state = self._table.get(node_id)
        if state is None or state.source != "attached" or state.node.endpoint != self._urls.get(node_id):
            return {}
        return {"Authorization": f"Bearer {token}"}


async def sweep_removed(table: RoutingTable, interval_s: float = 0.5) -> None:
    """Drop, every `interval_s`, the nodes deleted from the registry whose last request ended in another
    serving process (`RoutingTable.sweep`); runs until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        table.sweep()


class _Fleet:
    """Lifecycle changes for every node: through the registry, or in the routing table for attached servers
    (which live in this daemon's config, not in the registry)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _attached(self, node_id: str) -> bool:
        state = self.gateway.table.get(node_id)
        return state is not None and state.source == "attached"

    async def set_lifecycle(self, node_id: str, status: NodeStatus | None) -> None:
        if self._attached(node_id):
            self.gateway.table.set_lifecycle(node_id, status)
        else:
            await self.gateway.registry.set_lifecycle(node_id, status)

    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        return await self.gateway.registry.register(node, ephemeral=ephemeral)

    async def deregister(self, node_id: str) -> None:
        if self._attached(node_id):
            self.gateway.table.apply_delete(node_id)
            logger.info("detached %s", node_id)
        else:
            await self.gateway.registry.deregister(node_id)
            self.gateway.local_nodes.forget(node_id)

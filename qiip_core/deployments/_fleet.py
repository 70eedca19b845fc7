"""The controller's view of the real fleet, and its hands on it: the routing table, provisioning tasks, the host pool,
QUADS and telemetry in; setups, teardowns and deregistrations out.

```
FleetObserver.observe()            replicas by deployment: the nodes and provisioning tasks that carry a deployment's
                                   name (`Node.deployment`, `ProvisioningTask.deployment`); the pool: [[hosts]], the
                                   hosts added with `qiip host add`, and the GPU hosts QUADS lends, each with what is
                                   known of it (GPUs live, declared or QUADS'; QUADS' window; occupant; last setup)
ProvisioningActuator.place(…)      Provisioner.start_setup with the deployment's name and template on the node
ProvisioningActuator.retire(…)     Provisioner.start_teardown (drains first unless forced)
ProvisioningActuator.forget(…)     deregister the node of a host that cannot be reached any more
```
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

from qiip_core._errors import NodeNotFound
from qiip_core.config import HostSpec, Settings
from qiip_core.deployments._controller import Observation
from qiip_core.deployments._hosts import GpuView, HostView, Occupant, QuadsWindow, declared_gpus
from qiip_core.deployments._reconcile import ObservedReplica
from qiip_core.deployments._resource import Deployment, ReplicaState, Template
from qiip_core.deployments._store import DeploymentStore
from qiip_core.lifecycle import Fleet
from qiip_core.nodes import DeploymentRef, NodeStatus
from qiip_core.provisioning import Provisioner, ProvisioningTask, SetupRequest, TaskState
from qiip_core.quads import QuadsSnapshot, conflict_at, next_reservation
from qiip_core.routing import NodeState, RoutingTable
from qiip_core.telemetry import TelemetryStore

__all__ = ["FleetObserver", "ProvisioningActuator", "gpu_memory_from_name"]

_GB_RE = re.compile(r"(\d{2,3})\s*GB\b", re.IGNORECASE)


def gpu_memory_from_name(product: str) -> int | None:
    """A GPU's memory in MiB as its product name states it (`NVIDIA A100-SXM4-80GB` → 81,920), or None.

    QUADS lists a host's GPUs by product and count, without memory; NVIDIA's data-centre names carry it.
    """
    match = _GB_RE.search(product)
    return int(match.group(1)) * 1024 if match else None


_LIFECYCLE = {
    NodeStatus.PROVISIONING: ReplicaState.PROVISIONING,
    NodeStatus.UNKNOWN: ReplicaState.STARTING,
    NodeStatus.RELAUNCHING: ReplicaState.STARTING,
    NodeStatus.HEALTHY: ReplicaState.READY,
    NodeStatus.UNHEALTHY: ReplicaState.UNHEALTHY,
    NodeStatus.DRAINING: ReplicaState.DRAINING,
    NodeStatus.FAILED: ReplicaState.FAILED,
    NodeStatus.RELAUNCH_FAILED: ReplicaState.FAILED,
}


class FleetObserver:
    """Reads the fleet for the controller (see the module's map).

    Args:
        settings: the daemon's settings (`[[hosts]]`).
        store: the added hosts.
        table: the routing table (nodes and their effective status).
        provisioner: provisioning task records.
        quads: QUADS' last good read, when QUADS is used.
        telemetry: live GPU readings by node id.
        clock: the time now.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        store: DeploymentStore,
        table: RoutingTable,
        provisioner: Provisioner,
        quads: Callable[[], QuadsSnapshot | None],
        telemetry: TelemetryStore,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.settings = settings
        self.store = store
        self.table = table
        self.provisioner = provisioner
        self.quads = quads
        self.telemetry = telemetry
        self.clock = clock

    async def observe(self) -> Observation:
        """The fleet now.

        Raises:
            QiipError: the task records or the added hosts cannot be read.
        """
        tasks = {t.hostname: t for t in await self.provisioner.tasks()}
        added = await self.store.hosts()
        states = {state.id: state for state in self.table if not state.removed}
        replicas = _replicas(states, tasks)
        snapshot = self.quads()
        now = self.clock()
        base = self._pool(added, snapshot, states, tasks)

        def hosts(window_s: float) -> list[HostView]:
            if snapshot is None:
                return base
            return [replace(h, quads=_window(h.name, snapshot, now, window_s)) for h in base]

        return Observation(replicas=replicas, hosts=hosts)

    def _pool(
        self,
        added: list[HostSpec],
        snapshot: QuadsSnapshot | None,
        states: Mapping[str, NodeState],
        tasks: Mapping[str, ProvisioningTask],
    ) -> list[HostView]:
        pool: dict[str, HostView] = {}
        for origin, specs in (("added", added), ("config", self.settings.hosts)):
            for spec in specs:  # the configuration's entry of a name wins over an added one
                pool[spec.name] = HostView(
                    name=spec.name,
                    origin=origin,  # type: ignore[arg-type]
                    labels=dict(spec.labels),
                    gpus=declared_gpus(spec),
                    gpus_from="declared" if spec.gpus else "none",
                    memory_mib=spec.memory_mib,
                )
        if snapshot is not None:
            for name, lent in snapshot.hosts.items():
                if name in pool or not lent.lendable:
                    continue
                product = lent.gpu_product or "unknown GPU"
                memory = gpu_memory_from_name(product)
                pool[name] = HostView(
                    name=name,
                    origin="quads",
                    labels={"quads": "true", **({"gpu_product": product} if lent.gpu_product else {})},
                    gpus=tuple(GpuView(i, product, memory) for i in range(lent.gpu_count)),
                    gpus_from="quads",
                )
        fresh = {node_id: reading for node_id, reading, _age in self.telemetry.fresh_with_age()}
        views = []
        for name, view in sorted(pool.items()):
            reading = fresh.get(name)
            if reading is not None and reading.gpus:
                gpus = tuple(
                    GpuView(g.index, g.name, g.memory_total_mib, max(0, g.memory_total_mib - g.memory_used_mib))
                    for g in reading.gpus
                )
                view = replace(view, gpus=gpus, gpus_from="live")
            views.append(_what_is_on(view, states.get(name), tasks.get(name)))
        return views


def _what_is_on(view: HostView, state: NodeState | None, task: ProvisioningTask | None) -> HostView:
    occupant: Occupant | None = None
    if task is not None and task.state is TaskState.RUNNING:
        who = task.deployment.name if task.deployment is not None else None
        occupant = Occupant("operation", f"{task.kind} by {task.owner} at {task.current_step}", who)
    elif state is not None:
        node = state.effective_node()
        who = node.deployment.name if node.deployment is not None else None
        occupant = Occupant("node", f"node {node.id} serving {node.model!r} ({state.status.value})", who)
    engines: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    failure = None
    if task is not None:
        if task.engine is not None and (task.kind == "teardown" or task.state is TaskState.SUCCEEDED):
            engines = frozenset({task.engine})  # a teardown stops the engine; its install stays
        if task.model is not None and task.state is TaskState.SUCCEEDED:
            models = frozenset({task.model})
        if task.state is TaskState.FAILED:
            failure = f"{task.kind} failed at {task.failed_step or task.current_step}: {task.error}"
    return replace(view, occupant=occupant, engines=engines, models=models, failure=failure)


def _window(host: str, snapshot: QuadsSnapshot, now: datetime, window_s: float) -> QuadsWindow | None:
    known = snapshot.hosts.get(host)
    if known is None:
        return None
    if not known.usable:
        return QuadsWindow(state="broken" if known.broken else "retired", conflict_at=now)
    at = conflict_at(host, snapshot, now, window_s)
    if at is None:
        return QuadsWindow(state="free")
    upcoming = next_reservation(snapshot.reservations.get(host, ()), now)
    who = upcoming.describe() if upcoming is not None else "QUADS (no reservation named)"
    return QuadsWindow(state="reserved", conflict_at=at, describe=who)


def _replicas(
    states: Mapping[str, NodeState], tasks: Mapping[str, ProvisioningTask]
) -> dict[str, list[ObservedReplica]]:
    found: dict[str, list[ObservedReplica]] = {}
    for host, state in states.items():
        node = state.effective_node()
        if node.deployment is None:
            continue
        task = tasks.get(host)
        kind = _LIFECYCLE.get(state.status, ReplicaState.STARTING)
        reason = state.last_error
        failed_at = None
        teardown_failed = interrupted = False
        if task is not None and task.deployment == node.deployment:
            if task.state is TaskState.RUNNING:
                kind = ReplicaState.TERMINATING if task.kind == "teardown" else ReplicaState.PROVISIONING
                reason = task.current_step
            elif task.kind == "teardown" and task.state is TaskState.FAILED:
                kind, teardown_failed, reason = ReplicaState.TERMINATING, True, task.error
            elif task.kind == "setup" and task.state is TaskState.FAILED:
                failed_at, reason = task.updated_at, f"{task.failed_step or task.current_step}: {task.error}"
                interrupted = task.interrupted
        if kind is ReplicaState.FAILED and failed_at is None:
            failed_at = state.last_error_at or (task.updated_at if task is not None else None)
        if kind is ReplicaState.READY and not state.eligible and not state.last_chance:
            kind = ReplicaState.UNHEALTHY  # healthy by its probe, but its breaker keeps requests away
        found.setdefault(node.deployment.name, []).append(
            ObservedReplica(
                host=host,
                template=node.deployment.template,
                state=kind,
                reason=reason,
                failed_at=failed_at,
                teardown_failed=teardown_failed,
                serving=kind is ReplicaState.READY,
                interrupted=interrupted,
            )
        )
    for host, task in tasks.items():
        if host in states or task.deployment is None:
            continue
        if task.state is TaskState.RUNNING and task.kind == "setup":
            state_kind, failed_at, reason = ReplicaState.PROVISIONING, None, task.current_step
        elif task.state is TaskState.FAILED and task.kind == "setup":
            # Failed before its node was registered: nothing runs there. Seen once so its failure counts.
            state_kind, failed_at = ReplicaState.FAILED, task.updated_at
            reason = f"{task.failed_step or task.current_step}: {task.error}"
        elif task.state is TaskState.RUNNING and task.kind == "teardown":
            state_kind, failed_at, reason = ReplicaState.TERMINATING, None, task.current_step
        else:
            continue
        found.setdefault(task.deployment.name, []).append(
            ObservedReplica(
                host=host,
                template=task.deployment.template,
                state=state_kind,
                reason=reason,
                failed_at=failed_at,
                registered=False,
                interrupted=task.interrupted,
            )
        )
    return found


class ProvisioningActuator:
    """The controller's hands on the fleet: the provisioner's operations (see the module's map).

    Args:
        provisioner: the daemon's provisioner.
        fleet: where nodes are registered (a forgotten node is deregistered there).
    """

    def __init__(self, provisioner: Provisioner, fleet: Fleet) -> None:
        self.provisioner = provisioner
        self.fleet = fleet

    async def place(self, deployment: Deployment, host: str, template: Template) -> None:
        """Start setting a replica up on `host` (`Provisioner.start_setup`).

        Raises:
            QiipError: refused before anything ran (the provisioner's refusals).
        """
        llama = template.engine.serves_gguf  # llama.cpp and Ollama: a GGUF of the catalog, planned
        request = SetupRequest(
            hostname=host,
            engine=template.engine,
            model=template.source.model,
            alias=deployment.name,
            managed=True,
            sizing=template.runtime.policy() if llama else None,
            artifact_id=template.source.artifact_id if llama else None,
            deployment=DeploymentRef(name=deployment.name, template=template.hash),
        )
        await self.provisioner.start_setup(request)

    async def retire(self, host: str, *, reason: str, force: bool) -> None:
        """Start draining and tearing down the replica on `host` (`Provisioner.start_teardown`); nothing when it is
        not registered any more.

        Raises:
            QiipError: refused before anything ran (`HostBusy`, …).
        """
        try:
            await self.provisioner.start_teardown(host, force=force, reason=reason)
        except NodeNotFound:
            return

    async def forget(self, host: str, *, reason: str) -> None:
        """Deregister the node on `host` without reaching the host.

        Raises:
            QiipError: the registry refused.
        """
        try:
            await self.fleet.deregister(host)
        except NodeNotFound:
            return

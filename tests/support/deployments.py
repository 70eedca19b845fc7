"""In-memory stand-ins for what the deployment controller reads and changes, for tests of the controller's loop
and for `bench/placement.py`: a deployment store, a leadership that always leads, and a fleet whose setups take
one pass (`InMemoryFleet.advance`). Named as stand-ins: the daemon never uses them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from qiip_core.config import HostSpec
from qiip_core.deployments import (
    Deployment,
    DeploymentStatus,
    DeploymentStore,
    HostView,
    Leadership,
    Observation,
    ObservedReplica,
    Occupant,
    ReplicaState,
    Template,
)

__all__ = ["AlwaysLeader", "InMemoryDeploymentStore", "InMemoryFleet"]


class InMemoryDeploymentStore(DeploymentStore):
    """IN-MEMORY STAND-IN for the state file or etcd (the benchmark measures the controller, not storage)."""

    def __init__(self) -> None:
        self.records: dict[str, Deployment] = {}
        self.status_records: dict[str, DeploymentStatus] = {}

    async def deployments(self) -> list[Deployment]:
        return [self.records[k] for k in sorted(self.records)]

    async def write(self, deployment: Deployment, *, expected_generation: int | None) -> Deployment:
        self.records[deployment.name] = deployment
        return deployment

    async def remove(self, name: str) -> None:
        self.records.pop(name, None)
        self.status_records.pop(name, None)

    async def statuses(self) -> dict[str, DeploymentStatus]:
        return dict(self.status_records)

    async def put_status(self, status: DeploymentStatus) -> None:
        self.status_records[status.name] = status

    async def hosts(self) -> list[HostSpec]:
        return []

    async def add_host(self, host: HostSpec) -> HostSpec:
        return host

    async def remove_host(self, name: str) -> None:
        return None


class AlwaysLeader(Leadership):
    """IN-MEMORY STAND-IN: this process always leads."""

    async def campaign(self) -> bool:
        self.token = 1
        return True

    async def resign(self) -> None:
        self.token = 0


@dataclass
class _Replica:
    deployment: str
    template: str
    state: ReplicaState


class InMemoryFleet:
    """IN-MEMORY STAND-IN for the provisioning actuator and the fleet it changes: setups take one pass."""

    def __init__(self, hosts: list[HostView]) -> None:
        self.hosts = hosts
        self.replicas: dict[str, _Replica] = {}

    def advance(self) -> None:
        """One pass of time: setups finish, teardowns end."""
        for host, replica in list(self.replicas.items()):
            if replica.state is ReplicaState.PROVISIONING:
                replica.state = ReplicaState.READY
            elif replica.state is ReplicaState.TERMINATING:
                del self.replicas[host]

    async def observe(self) -> Observation:
        by_deployment: dict[str, list[ObservedReplica]] = {}
        for host, r in self.replicas.items():
            by_deployment.setdefault(r.deployment, []).append(
                ObservedReplica(host=host, template=r.template, state=r.state, serving=r.state is ReplicaState.READY)
            )
        occupied = {h: Occupant("node", f"replica of {r.deployment}", r.deployment) for h, r in self.replicas.items()}
        views = [replace(h, occupant=occupied.get(h.name)) for h in self.hosts]
        return Observation(replicas=by_deployment, hosts=lambda _window: views)

    async def place(self, deployment: Deployment, host: str, template: Template) -> None:
        self.replicas[host] = _Replica(deployment.name, template.hash, ReplicaState.PROVISIONING)

    async def retire(self, host: str, *, reason: str, force: bool) -> None:
        if host in self.replicas:
            self.replicas[host].state = ReplicaState.TERMINATING

    async def forget(self, host: str, *, reason: str) -> None:
        self.replicas.pop(host, None)

"""Deployments: declare a model and its replicas; QIIP places them on fitting hosts, provisions them, and keeps
them through failures, QUADS reclaims and rollouts.

```
DeploymentSpec / parse_spec(data)              what an operator writes (TOML or JSON), checked field by field
Deployment, Template, DeploymentStatus         the stored record (with its generation and resolved template)
                                               and what the controller observed and decided
HostSpec / HostView                            the host pool: declared, added, QUADS-lent; and what is known now
place(deployment, hosts, …)                    filter, score, choose; an explain for every host
reconcile(deployment, status, replicas, …)     one pure pass: the next idempotent steps and the new status
DeploymentController                           the loop: leader lease, observe, reconcile, act, store status
DeploymentStore (embedded, etcd)               records, statuses and added hosts in the registry's backend
autoscale(policy, state, demand, …)            the replica count a deployment's load needs (pure)
DemandMeter, DemandExchange, merge_demands     what each gateway measures of a model's traffic, shared over etcd
plan_capacity(deployment, hosts, load, …)      the replicas and hosts a stated load needs (`qiip deploy plan`)
Leadership (file lock, etcd lease)             one active controller per fleet, with a fencing token
```
"""

from __future__ import annotations

from qiip_core.deployments._apply import Resolve, apply, delete, resolve_source, rollout, scale, undo
from qiip_core.deployments._autoscale import Demand, autoscale, metric_of
from qiip_core.deployments._capacity import CapacityPlan, Decode, Load, PlannedReplica, plan_capacity
from qiip_core.deployments._controller import Actuator, DeploymentController, Observation, Observer
from qiip_core.deployments._demand import (
    DemandExchange,
    DemandMeter,
    EtcdDemandExchange,
    LocalDemandExchange,
    create_demand_exchange,
    merge_demands,
)
from qiip_core.deployments._fit import PlannerFit
from qiip_core.deployments._fleet import FleetObserver, ProvisioningActuator, gpu_memory_from_name
from qiip_core.deployments._hosts import (
    GpuSpec,
    GpuView,
    HostGroups,
    HostPool,
    HostSpec,
    HostView,
    Occupant,
    QuadsWindow,
    declared_gpus,
)
from qiip_core.deployments._leader import EtcdLeadership, FileLeadership, Leadership, create_leadership
from qiip_core.deployments._placement import BatchFitCheck, Fit, FitCheck, PlacementInput, host_devices, place
from qiip_core.deployments._reconcile import (
    Action,
    Decision,
    Forget,
    ObservedReplica,
    Place,
    ReconcileConfig,
    RemoveDeployment,
    Retire,
    reconcile,
)
from qiip_core.deployments._resource import (
    MAX_EVENTS,
    MAX_HISTORY,
    AutoscaleStatus,
    Condition,
    Deployment,
    DeploymentEvent,
    DeploymentStatus,
    HostChoice,
    HostFailure,
    PlacementExplain,
    ReplicaState,
    ReplicaStatus,
    ResolvedSource,
    RolloutStatus,
    Template,
)
from qiip_core.deployments._service import DeploymentService, expected_models, read_template_shape
from qiip_core.deployments._spec import (
    DEPLOYMENT_NAME_RE,
    Autoscale,
    Capacity,
    DeploymentSpec,
    HubSource,
    Placement,
    Runtime,
    Source,
    UpdateStrategy,
    parse_spec,
)
from qiip_core.deployments._store import (
    DeploymentStore,
    EmbeddedDeploymentStore,
    EtcdDeploymentStore,
    create_deployment_store,
)

__all__ = [
    "DEPLOYMENT_NAME_RE",
    "MAX_EVENTS",
    "MAX_HISTORY",
    "Action",
    "Actuator",
    "Autoscale",
    "AutoscaleStatus",
    "BatchFitCheck",
    "Capacity",
    "CapacityPlan",
    "Condition",
    "Decision",
    "Decode",
    "Demand",
    "DemandExchange",
    "DemandMeter",
    "Deployment",
    "DeploymentController",
    "DeploymentEvent",
    "DeploymentService",
    "DeploymentSpec",
    "DeploymentStatus",
    "DeploymentStore",
    "EmbeddedDeploymentStore",
    "EtcdDemandExchange",
    "EtcdDeploymentStore",
    "EtcdLeadership",
    "FileLeadership",
    "Fit",
    "FitCheck",
    "FleetObserver",
    "Forget",
    "GpuSpec",
    "GpuView",
    "HostChoice",
    "HostFailure",
    "HostGroups",
    "HostPool",
    "HostSpec",
    "HostView",
    "HubSource",
    "Leadership",
    "Load",
    "LocalDemandExchange",
    "Observation",
    "ObservedReplica",
    "Observer",
    "Occupant",
    "Place",
    "Placement",
    "PlacementExplain",
    "PlacementInput",
    "PlannedReplica",
    "PlannerFit",
    "ProvisioningActuator",
    "QuadsWindow",
    "ReconcileConfig",
    "RemoveDeployment",
    "ReplicaState",
    "ReplicaStatus",
    "Resolve",
    "ResolvedSource",
    "Retire",
    "RolloutStatus",
    "Runtime",
    "Source",
    "Template",
    "UpdateStrategy",
    "apply",
    "autoscale",
    "create_demand_exchange",
    "create_deployment_store",
    "create_leadership",
    "declared_gpus",
    "delete",
    "expected_models",
    "gpu_memory_from_name",
    "host_devices",
    "merge_demands",
    "metric_of",
    "parse_spec",
    "place",
    "plan_capacity",
    "read_template_shape",
    "reconcile",
    "resolve_source",
    "rollout",
    "scale",
    "undo",
]

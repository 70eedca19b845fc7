"""The stored deployment, its resolved template, and the status its controller writes.

```
Deployment                      what `apply` stores (one record per name)
├── spec: DeploymentSpec        as the operator wrote it
├── generation                  +1 on every change of the spec (the precondition of `replace`)
├── template: Template          the spec's engine, source and runtime, the source resolved (artifact id, hub
│                               commit), with a `hash` every replica carries: replicas of another hash are old
└── history: [Template]         earlier templates, newest first (`rollout undo` goes back to the first)

DeploymentStatus                what the controller observed and decided (one record per name)
├── observed_generation         the generation the controller last acted on
├── replicas: [ReplicaStatus]   each replica's host, state, template hash and since when
├── conditions                  Progressing, Available, Degraded: a status, a reason and a message each
├── events: [DeploymentEvent]   the newest `MAX_EVENTS` decisions and observations
├── rollout                     the template being rolled out, failures, whether it is paused and why
├── explain                     the last placement decision: every host, chosen or not, and why
├── host_failures               hosts where a replica failed recently (placement avoids them for a while)
└── autoscale                   the metric's recent values, the recommendation, the windows' state
```

Nothing here does I/O; `_store` persists both records.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from enum import StrEnum
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from qiip_core.deployments._spec import DeploymentSpec, Runtime
from qiip_core.nodes import ProvisionedEngine

__all__ = [
    "MAX_EVENTS",
    "MAX_HISTORY",
    "AutoscaleStatus",
    "Condition",
    "Deployment",
    "DeploymentEvent",
    "DeploymentStatus",
    "HostChoice",
    "HostFailure",
    "PlacementExplain",
    "ReplicaState",
    "ReplicaStatus",
    "ResolvedSource",
    "RolloutStatus",
    "Template",
    "utc_now",
]

MAX_EVENTS = 100
"""Events kept per deployment, newest last."""
MAX_HISTORY = 10
"""Earlier templates kept per deployment for `rollout undo`."""

_RECORD = ConfigDict(extra="ignore", frozen=True)


def utc_now() -> datetime:
    """The current time in UTC."""
    return datetime.now(UTC)


class ResolvedSource(BaseModel):
    """A source resolved to exact files, so that every replica of a template serves the same bytes."""

    model_config = _RECORD

    model: str
    """What the engine is given: llama.cpp, the GGUF's path relative to the shared model cache; vLLM, the hub
    repository id."""
    artifact_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """llama.cpp: the GGUF generation's full id."""
    revision: str | None = None
    """The hub commit (40 hex) the source was resolved to, when it came from the hub."""
    describe: str = ""
    """One line for operators (`artifact 4f1c2b8e0a9d (org/name@1a2b3c4 model.gguf)`)."""


class Template(BaseModel):
    """What every replica of one generation runs: the engine, the exact source, the runtime."""

    model_config = _RECORD

    engine: ProvisionedEngine
    """The inference engine."""
    source: ResolvedSource
    """The exact files."""
    runtime: Runtime = Field(default_factory=Runtime)
    """How the engine is sized."""
    written: dict[str, Any] = Field(default_factory=dict)
    """The `source` table as the operator wrote it (for `rollout undo` and display)."""

    @cached_property
    def hash(self) -> str:
        """12 hex characters of the SHA-256 of the engine, the resolved source's files and the runtime: replicas
        of another hash run something else and are replaced by a rollout."""
        body = {
            "engine": self.engine,
            "model": self.source.model,
            "artifact_id": self.source.artifact_id,
            "revision": self.source.revision,
            "runtime": self.runtime.model_dump(mode="json", exclude_none=True),
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


class Deployment(BaseModel):
    """One stored deployment (see the module's map)."""

    model_config = _RECORD

    spec: DeploymentSpec
    """As the operator wrote it."""
    generation: int = Field(default=1, ge=1)
    """+1 on every change of the spec."""
    template: Template
    """The template replicas must run."""
    history: tuple[Template, ...] = ()
    """Earlier templates, newest first, at most `MAX_HISTORY`."""
    created_at: datetime = Field(default_factory=utc_now)
    """When it was first applied (UTC)."""
    updated_at: datetime = Field(default_factory=utc_now)
    """When its spec last changed (UTC)."""
    deleting: bool = False
    """Deletion was asked: the controller drains and tears down its replicas, then removes the record."""

    @property
    def id(self) -> str:
        """The record's key: the deployment's name."""
        return self.spec.name

    @property
    def name(self) -> str:
        """The deployment's name (the model clients send)."""
        return self.spec.name

    def view(self) -> dict[str, Any]:
        """The record as the admin API shows it: `{name, generation, spec, template: {hash, …}, history, …}`."""
        data = self.model_dump(mode="json", exclude_none=True)
        data["name"] = self.name
        data["template"]["hash"] = self.template.hash
        for entry, template in zip(data["history"], self.history, strict=True):
            entry["hash"] = template.hash
        return data


class ReplicaState(StrEnum):
    """Where a replica is. A replica is one host serving the deployment's model."""

    PROVISIONING = "provisioning"
    """Its setup runs: power, SSH, the bundle, the engine (the step is in `reason`)."""
    STARTING = "starting"
    """Registered, its engine loading or not yet seen healthy."""
    READY = "ready"
    """Healthy and routable."""
    UNHEALTHY = "unhealthy"
    """Registered but failing health checks or its circuit breaker is open."""
    DRAINING = "draining"
    """Finishing its requests before a teardown."""
    TERMINATING = "terminating"
    """Its teardown runs."""
    FAILED = "failed"
    """Its setup failed, or its node failed; it is replaced and torn down."""


class ReplicaStatus(BaseModel):
    """One replica as the controller last saw it."""

    model_config = _RECORD

    host: str
    """The host (also the node's id)."""
    template: str
    """The template hash it runs."""
    state: ReplicaState
    """Where it is."""
    since: datetime
    """When it entered `state` (UTC)."""
    reason: str | None = None
    """Why it is in `state` (the setup step, the failure, the drain's cause)."""
    retiring: str | None = None
    """Why the controller is taking it away (scale-down, rollout, QUADS reclaim, failure), once it decided so."""


class Condition(BaseModel):
    """One aspect of a deployment, as Kubernetes conditions are read: a type, a status, a reason, a message."""

    model_config = _RECORD

    type: Literal["Available", "Progressing", "Degraded"]
    """`Available`: at least `replicas - max_unavailable` replicas serve; `Progressing`: the replicas converge
    on the template (false: a paused rollout); `Degraded`: fewer replicas serve than desired."""
    status: bool
    """Whether the condition holds."""
    reason: str
    """One CamelCase word (`MinimumReplicasAvailable`, `RolloutPaused`, `NoFittingHost`)."""
    message: str = ""
    """A sentence for operators."""
    since: datetime = Field(default_factory=utc_now)
    """When `status` last changed."""


class DeploymentEvent(BaseModel):
    """One thing the controller decided or saw."""

    model_config = _RECORD

    at: datetime
    """When (UTC)."""
    kind: str
    """`placed`, `provisioning`, `healthy`, `replaced`, `draining`, `torn_down`, `failed`, `scaled`, `rollout`,
    `paused`, `unplaceable`, `reclaim`, `deleting`, `recommendation`."""
    message: str
    """A sentence for operators."""
    host: str | None = None
    """The host concerned, if one is."""
    seq: int = 0
    """A number that grows with every event of the deployment (for followers: resume after the last seen)."""


class HostChoice(BaseModel):
    """One host as the last placement weighed it."""

    model_config = _RECORD

    host: str
    """The host."""
    eligible: bool
    """Whether every filter passed."""
    reasons: tuple[str, ...] = ()
    """Why it was refused (each filter that failed), or what its score is made of."""
    score: float | None = None
    """The score of an eligible host (higher is chosen first)."""
    chosen: bool = False
    """Whether a replica was placed there."""


class PlacementExplain(BaseModel):
    """The last placement decision of a deployment."""

    model_config = _RECORD

    at: datetime
    """When it was made (UTC)."""
    template: str
    """The template hash placed."""
    wanted: int
    """How many replicas it had to place."""
    hosts: tuple[HostChoice, ...]
    """Every host of the pool: the chosen first, then eligible by score, then the refused by name."""


class HostFailure(BaseModel):
    """A replica failed on this host recently: placement avoids it until `until`."""

    model_config = _RECORD

    at: datetime
    """When it last failed (UTC)."""
    until: datetime
    """Placement avoids the host until then (UTC); doubles with each failure, up to an hour."""
    count: int = 1
    """Failures in a row."""
    reason: str = ""
    """The last failure."""


class RolloutStatus(BaseModel):
    """The rollout of the current template."""

    model_config = _RECORD

    template: str = ""
    """The template hash rolled out."""
    failures: int = 0
    """Replicas of this template that failed to become ready."""
    paused: bool = False
    """Whether the rollout stopped creating replicas of this template."""
    reason: str | None = None
    """Why it paused."""


class AutoscaleStatus(BaseModel):
    """What the autoscaler measured and decided (see `qiip_core.deployments.Autoscaler`)."""

    model_config = _RECORD

    desired: int | None = None
    """The replica count it asks for (acted on only in `active` mode)."""
    recommendation: int | None = None
    """The count it would choose now (shown in every mode but `off`)."""
    metric: float | None = None
    """The metric's latest value."""
    samples: tuple[tuple[float, float], ...] = ()
    """Recent `(unix time, value)` samples, oldest first, bounded."""
    above_since: datetime | None = None
    """Since when the metric has been above target (the up window), or None."""
    below_since: datetime | None = None
    """Since when it has been below `target × (1 − tolerance)` (the down window), or None."""
    last_scale_at: datetime | None = None
    """The last step (for the cooldown)."""
    last_request_at: datetime | None = None
    """When a request for the model last arrived (scale to zero waits for idleness)."""
    reason: str | None = None
    """Why the last recommendation is what it is."""


class DeploymentStatus(BaseModel):
    """What the controller last observed and decided for one deployment (see the module's map)."""

    model_config = _RECORD

    name: str
    """The deployment."""
    observed_generation: int = 0
    """The generation acted on."""
    desired: int = 0
    """Replicas wanted now (the spec's, or the autoscaler's in active mode)."""
    ready: int = 0
    """Replicas serving."""
    updated: int = 0
    """Replicas of the current template (any state but terminating)."""
    available: int = 0
    """Replicas of the current template serving."""
    replicas: tuple[ReplicaStatus, ...] = ()
    """Every replica, by host."""
    conditions: tuple[Condition, ...] = ()
    """Progressing, Available, Degraded."""
    events: tuple[DeploymentEvent, ...] = ()
    """The newest events, oldest first, at most `MAX_EVENTS`."""
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    """The current template's rollout."""
    explain: PlacementExplain | None = None
    """The last placement decision."""
    host_failures: dict[str, HostFailure] = Field(default_factory=dict)
    """Hosts placement avoids for now, by name."""
    autoscale: AutoscaleStatus = Field(default_factory=AutoscaleStatus)
    """The autoscaler's state."""
    controller: str | None = None
    """The gateway whose controller wrote this."""
    updated_at: datetime = Field(default_factory=utc_now)
    """When it was written (UTC)."""

    @property
    def id(self) -> str:
        """The record's key: the deployment's name."""
        return self.name

    def condition(self, kind: str) -> Condition | None:
        """The condition of this type, if set."""
        return next((c for c in self.conditions if c.type == kind), None)

    def view(self) -> dict[str, Any]:
        """The status as the admin API shows it."""
        return self.model_dump(mode="json", exclude_none=True)

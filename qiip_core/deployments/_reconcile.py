"""One reconcile pass of one deployment, as a pure function: desired and observed state in, the next idempotent
steps and the new status out. No I/O, no clock, no memory between passes beyond the stored status, so a
restarted (or another gateway's) controller takes the same steps from the same state.

```
observe     replicas = the fleet's nodes and provisioning tasks that carry this deployment's name
classify    broken    failed, unhealthy past `replace_after_s`, starting past `start_timeout_s`
            leaving   draining or terminating
            outdated  another template, or a host QUADS wants back inside the window (evacuate)
            current   the rest: this template, staying
decide      deleting      → retire every replica, then remove the record
            broken        → retire it (teardown; forget the node when the teardown failed: the host is gone);
                            its host is avoided for a while, its failures may pause the rollout
            create        → place `desired - current` replicas, with at most `desired + max_surge` in all (leaving
                            and broken ones included) while outdated ones remain (none while the rollout is paused)
            remove        → outdated ones not serving; then outdated serving ones while at least
                            `desired - max_unavailable` would still serve; then current ones above `desired`
                            (those QUADS wants back soonest first)
report      replicas, counts, conditions, events
```

Make-before-break follows from the defaults: `max_surge` 1 and `max_unavailable` 0 create the replacement of an
outdated replica (a rollout, a QUADS reclaim) before it is taken away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from qiip_core.deployments._hosts import HostPool, HostView
from qiip_core.deployments._placement import FitCheck, PlacementInput, place
from qiip_core.deployments._resource import (
    MAX_EVENTS,
    Condition,
    Deployment,
    DeploymentEvent,
    DeploymentStatus,
    HostFailure,
    ReplicaState,
    ReplicaStatus,
    RolloutStatus,
    Template,
)

__all__ = [
    "Action",
    "Decision",
    "Forget",
    "ObservedReplica",
    "Place",
    "ReconcileConfig",
    "RemoveDeployment",
    "Retire",
    "reconcile",
]

_FAR = datetime.max.replace(tzinfo=None)


@dataclass(frozen=True)
class ObservedReplica:
    """One replica as the fleet shows it now: a node, or an operation, that carries the deployment's name."""

    host: str
    """The host (the node's id)."""
    template: str
    """The template hash it was created with."""
    state: ReplicaState
    """Where it is (`FAILED`: its node failed, or its setup failed)."""
    reason: str | None = None
    """The setup step, the node's last error, the failure."""
    failed_at: datetime | None = None
    """When its setup (or its node) failed, for a failed replica: the failure's identity across passes."""
    teardown_failed: bool = False
    """Its last teardown failed (the host is unreachable): the node is forgotten instead."""
    serving: bool = False
    """Whether it is routable (ready)."""
    registered: bool = True
    """Whether a node is registered for it; False for an operation that has not registered one (yet): a failed
    setup that never did leaves nothing to tear down, only a failure to count."""
    interrupted: bool = False
    """Its setup failed because the gateway running it died, not because of the host or the template: it is torn
    down as any failed replica, but counts against neither the rollout nor the host."""


@dataclass(frozen=True)
class Place:
    """Set a new replica up on `host` (the provisioning actuator's setup)."""

    host: str
    template: Template
    reason: str


@dataclass(frozen=True)
class Retire:
    """Drain the replica on `host`, stop its engine, deregister it (the provisioning actuator's teardown)."""

    host: str
    reason: str
    force: bool = False
    """Skip the drain: the replica serves nothing (failed, or never became ready)."""


@dataclass(frozen=True)
class Forget:
    """Deregister the node on `host` without touching the host: its teardown failed because it is unreachable."""

    host: str
    reason: str


@dataclass(frozen=True)
class RemoveDeployment:
    """Delete the deployment's record and status: it was deleted and no replica is left."""


Action = Place | Retire | Forget | RemoveDeployment
"""One step the controller takes."""


@dataclass(frozen=True)
class ReconcileConfig:
    """The controller's settings a pass needs (`[deployments]`)."""

    replace_after_s: float = 30.0
    """A replica unhealthy this long is replaced."""
    start_timeout_s: float = 600.0
    """A registered replica not healthy after this long is replaced."""
    failure_backoff_s: float = 60.0
    """A host where a replica failed is avoided this long, doubled per failure in a row (at most an hour)."""
    rollout_max_failures: int = 3
    """Replicas of one template that may fail before its rollout pauses."""
    quads_free_for_s: float = 86_400.0
    """How long QUADS must leave a host free (a deployment's `placement.quads_free_for_s` overrides it)."""
    cpu_profile: bool = False
    """Replicas are planned on host RAM (`provisioning.profile = "cpu"`)."""


@dataclass
class Decision:
    """The outcome of a pass."""

    actions: list[Action] = field(default_factory=list)
    """The steps to take, in order."""
    status: DeploymentStatus | None = None
    """The status to store."""


def _event(
    events: list[DeploymentEvent], seq: int, now: datetime, kind: str, message: str, host: str | None = None
) -> int:
    events.append(DeploymentEvent(at=now, kind=kind, message=message, host=host, seq=seq + 1))
    return seq + 1


def _backoff(failure: HostFailure | None, now: datetime, at: datetime, reason: str, base_s: float) -> HostFailure:
    count = 1 if failure is None else failure.count + 1
    delay = min(3600.0, base_s * 2.0 ** min(count - 1, 10))
    return HostFailure(at=at, until=max(now, at) + timedelta(seconds=delay), count=count, reason=reason)


def _is_broken(
    replica: ObservedReplica, previous: ReplicaStatus | None, now: datetime, config: ReconcileConfig
) -> bool:
    if replica.state is ReplicaState.FAILED:
        return True
    since = previous.since if previous is not None and previous.state is replica.state else now
    age = (now - since).total_seconds()
    if replica.state is ReplicaState.UNHEALTHY:
        return age >= config.replace_after_s
    if replica.state is ReplicaState.STARTING:
        return age >= config.start_timeout_s
    return False


def _evacuating(host: HostView | None) -> bool:
    return host is not None and host.quads is not None and host.quads.state != "free"


def _removal_order(replica: ObservedReplica, hosts: Mapping[str, HostView]) -> tuple[bool, datetime, str]:
    view = hosts.get(replica.host)
    conflict = view.quads.conflict_at if view is not None and view.quads is not None else None
    when = conflict.replace(tzinfo=None) if conflict is not None else _FAR
    return (replica.serving, when, replica.host)


def reconcile(
    deployment: Deployment,
    previous: DeploymentStatus | None,
    observed: Sequence[ObservedReplica],
    hosts: HostPool | Sequence[HostView],
    *,
    now: datetime,
    config: ReconcileConfig,
    fit: FitCheck,
    desired: int | None = None,
    owner: str | None = None,
    busy: Mapping[str, str] | None = None,
) -> Decision:
    """Decide the next steps for one deployment.

    Args:
        deployment: the stored deployment.
        previous: the status the last pass stored (None for a new deployment).
        observed: its replicas as the fleet shows them now.
        hosts: every host of the pool, observed (replicas of this deployment show as their hosts' occupant).
        busy: hosts this pass placed another deployment's replica on (by host: that deployment).
        now: the current time (aware, UTC).
        config: the controller's settings.
        fit: the planner's check of a template on a host's devices.
        desired: the replica count to hold (the autoscaler's, in active mode); None: `spec.replicas`.
        owner: the gateway deciding, recorded in the status.

    Returns:
        The actions, in order, and the new status.
    """
    pool = hosts if isinstance(hosts, HostPool) else HostPool.of(hosts)
    step = _Pass(deployment, previous or DeploymentStatus(name=deployment.name), pool, now=now, config=config)
    step.want = deployment.spec.replicas if desired is None else desired
    step.note_changes(observed)
    # A setup that failed before registering its node left nothing behind: its failure is counted above, and it
    # is no replica any more.
    observed = [r for r in observed if r.registered or r.state is not ReplicaState.FAILED]
    step.failures = {h: f for h, f in step.failures.items() if f.until > now - timedelta(hours=6)}
    step.pause_if_failing(observed)
    group = step.classify(observed)
    step.forget_unreachable(group.leaving)
    if deployment.deleting:
        for replica in group.broken + group.current + group.outdated:
            step.retire(replica, "the deployment is being deleted", "deleting")
        if not observed:
            step.decision.actions.append(RemoveDeployment())
        step.want = 0
    else:
        step.replace_broken(group.broken)
        step.create(group, holding=frozenset(r.host for r in observed), fit=fit, busy=busy or {})
        step.remove(group)
    step.decision.status = step.report(observed, group.outdated, owner=owner)
    return step.decision


@dataclass(frozen=True)
class _Groups:
    """The replicas of a pass, by what is to be done with them (the module's "classify")."""

    broken: list[ObservedReplica]
    leaving: list[ObservedReplica]
    current: list[ObservedReplica]
    outdated: list[ObservedReplica]


class _Pass:
    """One pass's working state: the events it writes, the failures and rollout it carries, the actions it takes.

    Each method is one phase of the module's table; `reconcile` calls them in that order.
    """

    def __init__(
        self, deployment: Deployment, prev: DeploymentStatus, pool: HostPool, *, now: datetime, config: ReconcileConfig
    ) -> None:
        self.deployment, self.prev, self.pool, self.now, self.config = deployment, prev, pool, now, config
        self.spec, self.template = deployment.spec, deployment.template
        self.want = deployment.spec.replicas
        self.prev_replicas = {r.host: r for r in prev.replicas}
        self.events: list[DeploymentEvent] = []
        self.seq = prev.events[-1].seq if prev.events else 0
        self.decision = Decision()
        self.failures = dict(prev.host_failures)
        self.retiring: dict[str, str] = {}
        self.explain = prev.explain
        self.rollout = prev.rollout
        if self.rollout.template != self.template.hash or prev.observed_generation != deployment.generation:
            self.rollout = RolloutStatus(template=self.template.hash)

    def event(self, kind: str, message: str, host: str | None = None) -> None:
        self.seq = _event(self.events, self.seq, self.now, kind, message, host)

    def note_changes(self, observed: Sequence[ObservedReplica]) -> None:
        """What changed since the last pass: events, and failures counted once (by their time)."""
        for replica in observed:
            before = self.prev_replicas.get(replica.host)
            host = replica.host
            if before is None:
                self.event("provisioning", f"replica on {host}: {replica.state.value}", host)
            elif before.state is not replica.state:
                if replica.state is ReplicaState.READY:
                    self.event("healthy", f"replica on {host} is ready", host)
                elif replica.state is ReplicaState.FAILED:
                    self.event("failed", f"replica on {host} failed: {replica.reason}", host)
                elif replica.state is ReplicaState.UNHEALTHY:
                    self.event("unhealthy", f"replica on {host}: {replica.reason or 'unhealthy'}", host)
            if replica.state is ReplicaState.FAILED and replica.failed_at is not None and not replica.interrupted:
                self._count_failure(replica, replica.failed_at)
        seen = {r.host for r in observed}
        for host in self.prev_replicas:
            if host not in seen:
                self.event("torn_down", f"replica on {host} is gone", host)

    def _count_failure(self, replica: ObservedReplica, failed_at: datetime) -> None:
        known = self.failures.get(replica.host)
        if known is None or failed_at > known.at:
            reason = replica.reason or "failed"
            self.failures[replica.host] = _backoff(known, self.now, failed_at, reason, self.config.failure_backoff_s)
            if replica.template == self.template.hash:
                self.rollout = self.rollout.model_copy(update={"failures": self.rollout.failures + 1})

    def pause_if_failing(self, observed: Sequence[ObservedReplica]) -> None:
        """Pause the rollout once `rollout_max_failures` replicas of this template failed."""
        rollout = self.rollout
        if rollout.paused or rollout.failures < self.config.rollout_max_failures:
            return
        template = self.template.hash
        last = next((r for r in observed if r.state is ReplicaState.FAILED and r.template == template), None)
        why = f"{rollout.failures} replicas of template {template} failed"
        if last is not None:
            why += f", the last on {last.host}: {last.reason}"
        self.rollout = rollout.model_copy(update={"paused": True, "reason": why})
        self.event(
            "paused",
            f"rollout paused: {why}; the other replicas keep serving "
            "(apply a fixed spec, or `qiip deploy rollout undo`)",
        )

    def classify(self, observed: Sequence[ObservedReplica]) -> _Groups:
        """Broken, leaving, outdated (another template, or its host evacuating) and current replicas."""
        group = _Groups(broken=[], leaving=[], current=[], outdated=[])
        for replica in observed:
            if replica.state in (ReplicaState.DRAINING, ReplicaState.TERMINATING):
                group.leaving.append(replica)
            elif _is_broken(replica, self.prev_replicas.get(replica.host), self.now, self.config):
                group.broken.append(replica)
            elif replica.template != self.template.hash or _evacuating(self.pool.by_name.get(replica.host)):
                group.outdated.append(replica)
            else:
                group.current.append(replica)
        return group

    def retire(self, replica: ObservedReplica, reason: str, kind: str) -> None:
        """Take `replica` away: tear it down (forced when it serves nothing), or forget it when its teardown failed;
        one still being set up is left until its setup ends."""
        if replica.teardown_failed:
            self.decision.actions.append(Forget(replica.host, reason))
        elif replica.state is not ReplicaState.PROVISIONING:
            self.decision.actions.append(Retire(replica.host, reason, force=not replica.serving))
        else:
            return
        self.retiring[replica.host] = reason
        self.event(kind, f"replica on {replica.host}: {reason}", replica.host)

    def forget_unreachable(self, leaving: Sequence[ObservedReplica]) -> None:
        """Leaving replicas whose teardown failed: the host is gone, forget the node."""
        for replica in leaving:
            if replica.teardown_failed:
                self.decision.actions.append(Forget(replica.host, "its teardown failed; the host cannot be reached"))
                self.retiring[replica.host] = "forgotten"

    def replace_broken(self, broken: Sequence[ObservedReplica]) -> None:
        """Retire each broken replica; its host is avoided for a while (a failed one's was counted already)."""
        config = self.config
        for replica in broken:
            why = replica.reason or replica.state.value
            if replica.state is ReplicaState.UNHEALTHY:
                why = f"unhealthy for over {config.replace_after_s:g} s ({why})"
            elif replica.state is ReplicaState.STARTING:
                why = f"not ready after {config.start_timeout_s:g} s"
            self.retire(replica, f"replaced: {why}", "replaced")
            if replica.state is not ReplicaState.FAILED and replica.host not in self.failures:
                self.failures[replica.host] = _backoff(None, self.now, self.now, why, config.failure_backoff_s)

    def create(self, group: _Groups, *, holding: frozenset[str], fit: FitCheck, busy: Mapping[str, str]) -> None:
        """Place `want - current` replicas, within `want + max_surge` held in all during a rollout; none while the
        rollout is paused."""
        spec, current, outdated = self.spec, group.current, group.outdated
        need = self.want - len(current)
        if outdated:
            # Every replica held counts against the surge, those still draining or being torn down and broken ones
            # included: each keeps its host (and its memory) until its teardown ends.
            held = len(current) + len(outdated) + len(group.leaving) + len(group.broken)
            need = min(need, self.want + spec.update.max_surge - held)
        if self.rollout.paused or need <= 0:
            return
        given = PlacementInput(
            now=self.now, cpu_profile=self.config.cpu_profile, host_failures=self.failures, holding=holding, busy=busy
        )
        asked = spec.placement.quads_free_for_s
        window = float(asked if asked is not None else self.config.quads_free_for_s)
        chosen, self.explain = place(
            self.deployment, self.pool, wanted=need, given=given, fit=fit, quads_free_for_s=window
        )
        for host in chosen:
            why = "rollout" if outdated else ("replacement" if group.broken else "scale up")
            self.decision.actions.append(Place(host, self.template, why))
            self.event("placed", f"replica placed on {host} ({why}, template {self.template.hash})", host)
        degraded = self.prev.condition("Degraded")
        if len(chosen) < need and (degraded is None or degraded.reason != "NoFittingHost"):
            self.event(
                "unplaceable",
                f"{need - len(chosen)} replica(s) cannot be placed: no host passes every filter (see explain)",
            )

    def remove(self, group: _Groups) -> None:
        """Outdated replicas not serving; then outdated serving ones while at least `want - max_unavailable` would
        still serve; then current ones above `want` (those QUADS wants back soonest first)."""
        by_host, current, outdated = self.pool.by_name, group.current, group.outdated
        serving_now = sum(1 for r in current + outdated if r.serving)
        floor = self.want - self.spec.update.max_unavailable
        for replica in sorted(outdated, key=lambda r: _removal_order(r, by_host)):
            evac = _evacuating(by_host.get(replica.host))
            kind = "reclaim" if evac and replica.template == self.template.hash else "rollout"
            reason = "QUADS takes its host back" if kind == "reclaim" else f"rollout to template {self.template.hash}"
            if not replica.serving:
                self.retire(replica, reason, kind)
            elif serving_now - 1 >= floor:
                self.retire(replica, reason, kind)
                serving_now -= 1
        extra = len(current) - self.want
        if extra > 0 and not outdated:
            for replica in sorted(current, key=lambda r: _removal_order(r, by_host))[:extra]:
                self.retire(replica, f"scaled down to {self.want}", "scaled")

    def report(
        self, observed: Sequence[ObservedReplica], outdated: Sequence[ObservedReplica], *, owner: str | None
    ) -> DeploymentStatus:
        """The status to store: each replica since when in its state, the counts, conditions and events."""
        replicas = [self._replica_status(replica) for replica in sorted(observed, key=lambda r: r.host)]
        template, want, prev = self.template.hash, self.want, self.prev
        ready = sum(1 for r in observed if r.serving)
        updated = sum(1 for r in observed if r.template == template and r.state is not ReplicaState.TERMINATING)
        available = sum(1 for r in observed if r.serving and r.template == template)
        conditions = _conditions(
            prev, self.deployment, want, ready, available, updated, self.rollout, self.decision, outdated, self.now
        )
        return DeploymentStatus(
            name=self.deployment.name,
            observed_generation=self.deployment.generation,
            desired=want,
            ready=ready,
            updated=updated,
            available=available,
            replicas=tuple(replicas),
            conditions=conditions,
            events=(prev.events + tuple(self.events))[-MAX_EVENTS:],
            rollout=self.rollout,
            explain=self.explain,
            host_failures=self.failures,
            autoscale=prev.autoscale,
            controller=owner,
            updated_at=self.now,
        )

    def _replica_status(self, replica: ObservedReplica) -> ReplicaStatus:
        before = self.prev_replicas.get(replica.host)
        same = before is not None and before.state is replica.state
        leaving = replica.state in (ReplicaState.DRAINING, ReplicaState.TERMINATING)
        return ReplicaStatus(
            host=replica.host,
            template=replica.template,
            state=replica.state,
            since=before.since if same and before is not None else self.now,
            reason=replica.reason,
            retiring=self.retiring.get(replica.host) or (before.retiring if before is not None and leaving else None),
        )


def _conditions(
    prev: DeploymentStatus,
    deployment: Deployment,
    want: int,
    ready: int,
    available: int,
    updated: int,
    rollout: RolloutStatus,
    decision: Decision,
    outdated: Sequence[ObservedReplica],
    now: datetime,
) -> tuple[Condition, ...]:
    spec = deployment.spec
    placed = sum(1 for a in decision.actions if isinstance(a, Place))
    floor = max(0, want - spec.update.max_unavailable)
    found = []
    if ready >= floor:
        found.append(
            Condition(
                type="Available",
                status=True,
                reason="MinimumReplicasAvailable",
                message=f"{ready} of {want} replicas serve",
            )
        )
    else:
        found.append(
            Condition(
                type="Available",
                status=False,
                reason="MinimumReplicasUnavailable",
                message=f"{ready} of {want} replicas serve; at least {floor} are needed",
            )
        )
    if deployment.deleting:
        found.append(Condition(type="Progressing", status=True, reason="Deleting", message="tearing replicas down"))
    elif rollout.paused:
        found.append(Condition(type="Progressing", status=False, reason="RolloutPaused", message=rollout.reason or ""))
    elif available >= want and updated == available and not outdated:
        found.append(
            Condition(
                type="Progressing",
                status=True,
                reason="NewReplicasAvailable",
                message=f"template {deployment.template.hash} serves on {available} replica(s)",
            )
        )
    else:
        found.append(
            Condition(
                type="Progressing",
                status=True,
                reason="ReplicasUpdating",
                message=f"{available} of {want} replicas of template {deployment.template.hash} serve",
            )
        )
    if ready >= want:
        found.append(
            Condition(type="Degraded", status=False, reason="AllReplicasReady", message=f"{ready} of {want} ready")
        )
    else:
        missing = want - ready
        in_progress = updated - available
        if rollout.paused:
            reason, message = "RolloutPaused", rollout.reason or "the rollout is paused"
        elif missing > in_progress + placed:
            reason = "NoFittingHost"
            message = f"{missing - in_progress - placed} replica(s) have no host: see explain for each host's reason"
        else:
            reason, message = "ReplicasStarting", f"{missing} replica(s) are being set up"
        found.append(Condition(type="Degraded", status=True, reason=reason, message=message))
    out = []
    for condition in found:
        before = prev.condition(condition.type)
        same = before is not None and before.status == condition.status
        out.append(condition.model_copy(update={"since": before.since if same and before else now}))
    return tuple(out)

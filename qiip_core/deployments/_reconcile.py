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
    spec = deployment.spec
    template = deployment.template
    want = spec.replicas if desired is None else desired
    prev = previous or DeploymentStatus(name=deployment.name)
    prev_replicas = {r.host: r for r in prev.replicas}
    pool = hosts if isinstance(hosts, HostPool) else HostPool.of(hosts)
    by_host = pool.by_name
    events: list[DeploymentEvent] = []
    seq = prev.events[-1].seq if prev.events else 0
    decision = Decision()
    failures = dict(prev.host_failures)
    rollout = prev.rollout
    if rollout.template != template.hash or prev.observed_generation != deployment.generation:
        rollout = RolloutStatus(template=template.hash)

    # -- what changed since the last pass: events, and failures counted once (by their time) ------------------
    for replica in observed:
        before = prev_replicas.get(replica.host)
        if before is None:
            seq = _event(
                events, seq, now, "provisioning", f"replica on {replica.host}: {replica.state.value}", replica.host
            )
        elif before.state is not replica.state:
            if replica.state is ReplicaState.READY:
                seq = _event(events, seq, now, "healthy", f"replica on {replica.host} is ready", replica.host)
            elif replica.state is ReplicaState.FAILED:
                seq = _event(
                    events, seq, now, "failed", f"replica on {replica.host} failed: {replica.reason}", replica.host
                )
            elif replica.state is ReplicaState.UNHEALTHY:
                seq = _event(
                    events,
                    seq,
                    now,
                    "unhealthy",
                    f"replica on {replica.host}: {replica.reason or 'unhealthy'}",
                    replica.host,
                )
        if replica.state is ReplicaState.FAILED and replica.failed_at is not None and not replica.interrupted:
            known = failures.get(replica.host)
            if known is None or replica.failed_at > known.at:
                failures[replica.host] = _backoff(
                    known, now, replica.failed_at, replica.reason or "failed", config.failure_backoff_s
                )
                if replica.template == template.hash:
                    rollout = rollout.model_copy(update={"failures": rollout.failures + 1})
    seen = {r.host for r in observed}
    for host in prev_replicas:
        if host not in seen:
            seq = _event(events, seq, now, "torn_down", f"replica on {host} is gone", host)
    # A setup that failed before registering its node left nothing behind: its failure is counted above, and it
    # is no replica any more.
    observed = [r for r in observed if r.registered or r.state is not ReplicaState.FAILED]
    failures = {h: f for h, f in failures.items() if f.until > now - timedelta(hours=6)}

    if not rollout.paused and rollout.failures >= config.rollout_max_failures:
        last = next((r for r in observed if r.state is ReplicaState.FAILED and r.template == template.hash), None)
        why = f"{rollout.failures} replicas of template {template.hash} failed"
        if last is not None:
            why += f", the last on {last.host}: {last.reason}"
        rollout = rollout.model_copy(update={"paused": True, "reason": why})
        seq = _event(
            events,
            seq,
            now,
            "paused",
            f"rollout paused: {why}; the other replicas keep serving "
            "(apply a fixed spec, or `qiip deploy rollout undo`)",
        )

    # -- classify --------------------------------------------------------------------------------------------
    broken: list[ObservedReplica] = []
    leaving: list[ObservedReplica] = []
    current: list[ObservedReplica] = []
    outdated: list[ObservedReplica] = []
    for replica in observed:
        if replica.state in (ReplicaState.DRAINING, ReplicaState.TERMINATING):
            leaving.append(replica)
        elif _is_broken(replica, prev_replicas.get(replica.host), now, config):
            broken.append(replica)
        elif replica.template != template.hash or _evacuating(by_host.get(replica.host)):
            outdated.append(replica)
        else:
            current.append(replica)
    retiring: dict[str, str] = {}
    explain = prev.explain

    def retire(replica: ObservedReplica, reason: str, kind: str) -> None:
        nonlocal seq
        force = not replica.serving
        if replica.teardown_failed:
            decision.actions.append(Forget(replica.host, reason))
        elif replica.state is not ReplicaState.PROVISIONING:
            decision.actions.append(Retire(replica.host, reason, force=force))
        else:
            return  # its setup still runs; taken away once it ends
        retiring[replica.host] = reason
        seq = _event(events, seq, now, kind, f"replica on {replica.host}: {reason}", replica.host)

    # Leaving replicas whose teardown failed: the host is gone, forget the node.
    for replica in leaving:
        if replica.teardown_failed:
            decision.actions.append(Forget(replica.host, "its teardown failed; the host cannot be reached"))
            retiring[replica.host] = "forgotten"

    if deployment.deleting:
        for replica in broken + current + outdated:
            retire(replica, "the deployment is being deleted", "deleting")
        if not observed:
            decision.actions.append(RemoveDeployment())
        want = 0
    else:
        for replica in broken:
            why = replica.reason or replica.state.value
            if replica.state is ReplicaState.UNHEALTHY:
                why = f"unhealthy for over {config.replace_after_s:g} s ({why})"
            elif replica.state is ReplicaState.STARTING:
                why = f"not ready after {config.start_timeout_s:g} s"
            retire(replica, f"replaced: {why}", "replaced")
            if replica.state is not ReplicaState.FAILED and replica.host not in failures:
                failures[replica.host] = _backoff(None, now, now, why, config.failure_backoff_s)

        # -- create ------------------------------------------------------------------------------------------
        need = want - len(current)
        if outdated:
            # Every replica held counts against the surge, those still draining or being torn down and broken ones
            # included: each keeps its host (and its memory) until its teardown ends.
            room = want + spec.update.max_surge - len(current) - len(outdated) - len(leaving) - len(broken)
            need = min(need, room)
        if rollout.paused:
            need = 0
        if need > 0:
            given = PlacementInput(
                now=now,
                cpu_profile=config.cpu_profile,
                host_failures=failures,
                holding=frozenset(r.host for r in observed),
                busy=busy or {},
            )
            window = float(
                spec.placement.quads_free_for_s
                if spec.placement.quads_free_for_s is not None
                else config.quads_free_for_s
            )
            chosen, explain = place(deployment, pool.hosts, wanted=need, given=given, fit=fit, quads_free_for_s=window)
            for host in chosen:
                why = "rollout" if outdated else ("replacement" if broken else "scale up")
                decision.actions.append(Place(host, template, why))
                seq = _event(
                    events, seq, now, "placed", f"replica placed on {host} ({why}, template {template.hash})", host
                )
            degraded = prev.condition("Degraded")
            if len(chosen) < need and (degraded is None or degraded.reason != "NoFittingHost"):
                message = f"{need - len(chosen)} replica(s) cannot be placed: no host passes every filter (see explain)"
                seq = _event(events, seq, now, "unplaceable", message)

        # -- remove ------------------------------------------------------------------------------------------
        serving_now = sum(1 for r in current + outdated if r.serving)
        floor = want - spec.update.max_unavailable
        for replica in sorted(outdated, key=lambda r: _removal_order(r, by_host)):
            evac = _evacuating(by_host.get(replica.host))
            kind = "reclaim" if evac and replica.template == template.hash else "rollout"
            reason = "QUADS takes its host back" if kind == "reclaim" else f"rollout to template {template.hash}"
            if not replica.serving:
                retire(replica, reason, kind)
            elif serving_now - 1 >= floor:
                retire(replica, reason, kind)
                serving_now -= 1
        extra = len(current) - want
        if extra > 0 and not outdated:
            for replica in sorted(current, key=lambda r: _removal_order(r, by_host))[:extra]:
                retire(replica, f"scaled down to {want}", "scaled")

    # -- report ----------------------------------------------------------------------------------------------
    prev_by_host = prev_replicas
    replicas = []
    for replica in sorted(observed, key=lambda r: r.host):
        before = prev_by_host.get(replica.host)
        since = before.since if before is not None and before.state is replica.state else now
        replicas.append(
            ReplicaStatus(
                host=replica.host,
                template=replica.template,
                state=replica.state,
                since=since,
                reason=replica.reason,
                retiring=retiring.get(replica.host)
                or (
                    before.retiring
                    if before is not None and replica.state in (ReplicaState.DRAINING, ReplicaState.TERMINATING)
                    else None
                ),
            )
        )
    ready = sum(1 for r in observed if r.serving)
    updated = sum(1 for r in observed if r.template == template.hash and r.state is not ReplicaState.TERMINATING)
    available = sum(1 for r in observed if r.serving and r.template == template.hash)
    conditions = _conditions(prev, deployment, want, ready, available, updated, rollout, decision, outdated, now)
    kept = (prev.events + tuple(events))[-MAX_EVENTS:]
    decision.status = DeploymentStatus(
        name=deployment.name,
        observed_generation=deployment.generation,
        desired=want,
        ready=ready,
        updated=updated,
        available=available,
        replicas=tuple(replicas),
        conditions=conditions,
        events=kept,
        rollout=rollout,
        explain=explain,
        host_failures=failures,
        autoscale=prev.autoscale,
        controller=owner,
        updated_at=now,
    )
    return decision


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

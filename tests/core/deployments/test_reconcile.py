"""One reconcile pass, as a pure function: placement with its explain, replacement, rollouts with surge, QUADS
reclaims make-before-break, paused rollouts, scale-down order and deletion."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from qiip_core.deployments import (
    Deployment,
    DeploymentStatus,
    Fit,
    Forget,
    HostView,
    ObservedReplica,
    Occupant,
    Place,
    QuadsWindow,
    ReconcileConfig,
    RemoveDeployment,
    ReplicaState,
    ResolvedSource,
    Retire,
    Template,
    parse_spec,
    reconcile,
)
from qiip_core.deployments._hosts import GpuView
from qiip_core.planner import DeviceMemory

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
CONFIG = ReconcileConfig(replace_after_s=30, start_timeout_s=600, failure_backoff_s=60, rollout_max_failures=2)


def deployment(replicas: int = 3, artifact: str = "a" * 64, generation: int = 1, **spec: Any) -> Deployment:
    parsed = parse_spec({"name": "coder", "source": {"artifact": artifact[:12]}, "replicas": replicas, **spec})
    template = Template(engine="llama_cpp", source=ResolvedSource(model=f"m/{artifact[:4]}.gguf", artifact_id=artifact))
    return Deployment(spec=parsed, template=template, generation=generation)


def fit(template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
    total = sum(d.total_mib for d in devices)
    if total < 16_000:
        return Fit(False, f"needs 16,000 MiB, has {total:,}")
    return Fit(True, "2 slots", used_mib=16_000, total_mib=total)


def host(name: str, memory_gib: int = 80, **kwargs: Any) -> HostView:
    return HostView(
        name=name, origin="config", gpus=(GpuView(0, "NVIDIA A100", memory_gib * 1024),), gpus_from="declared", **kwargs
    )


def replica(name: str, template: str, state: ReplicaState = ReplicaState.READY, **kwargs: Any) -> ObservedReplica:
    return ObservedReplica(host=name, template=template, state=state, serving=state is ReplicaState.READY, **kwargs)


def run(
    dep: Deployment,
    observed: list[ObservedReplica],
    hosts: list[HostView],
    previous: DeploymentStatus | None = None,
    now: datetime = NOW,
):
    decision = reconcile(dep, previous, observed, hosts, now=now, config=CONFIG, fit=fit, owner="gw1")
    assert decision.status is not None
    return decision.actions, decision.status


def test_a_new_deployment_is_placed_on_the_best_fitting_hosts_and_the_rest_are_explained() -> None:
    dep = deployment(3)
    reserved = QuadsWindow(state="reserved", conflict_at=NOW + timedelta(hours=3), describe="cloud02 (owner alice)")
    hosts = [host("h1"), host("h2", 8), host("h3", quads=reserved), host("h4"), host("h5"), host("h6", 40)]
    actions, status = run(dep, [], hosts)
    placed = [a.host for a in actions if isinstance(a, Place)]
    assert placed == ["h6", "h1", "h4"]  # binpack: the tightest fit first, then by name
    reasons = {c.host: c.reasons for c in status.explain.hosts if not c.eligible}
    assert "does not fit: needs 16,000 MiB, has 8,192" in reasons["h2"][0]
    assert "QUADS reserves it from 2026-12-01 15:00 UTC for cloud02 (owner alice)" in reasons["h3"][0]
    assert [c.host for c in status.explain.hosts if c.chosen] == ["h6", "h1", "h4"]
    assert status.condition("Degraded").reason == "ReplicasStarting"


def test_steady_state_takes_no_step() -> None:
    dep = deployment(2)
    observed = [replica("h1", dep.template.hash), replica("h2", dep.template.hash)]
    actions, status = run(dep, observed, [host("h1"), host("h2"), host("h3")])
    assert actions == []
    assert (status.ready, status.available, status.updated) == (2, 2, 2)
    assert status.condition("Available").status and not status.condition("Degraded").status


def test_a_replica_unhealthy_past_the_grace_is_replaced_then_retired() -> None:
    dep = deployment(2)
    h = dep.template.hash
    first_actions, first = run(
        dep,
        [replica("h1", h), replica("h2", h, ReplicaState.UNHEALTHY, reason="refused")],
        [host("h1"), host("h2"), host("h3")],
    )
    assert first_actions == []  # inside the grace
    later = NOW + timedelta(seconds=31)
    actions, status = run(
        dep,
        [replica("h1", h), replica("h2", h, ReplicaState.UNHEALTHY, reason="refused")],
        [host("h1"), host("h2"), host("h3")],
        first,
        later,
    )
    assert Retire("h2", "replaced: unhealthy for over 30 s (refused)", force=True) in actions
    assert [a.host for a in actions if isinstance(a, Place)] == ["h3"]
    assert "h2" in status.host_failures


def test_a_rollout_surges_one_replica_and_retires_an_old_one_only_once_the_new_one_serves() -> None:
    old = deployment(2, artifact="a" * 64)
    new = deployment(2, artifact="b" * 64, generation=2)
    hosts = [host("h1"), host("h2"), host("h3"), host("h4")]
    old_replicas = [replica("h1", old.template.hash), replica("h2", old.template.hash)]
    actions, status = run(new, old_replicas, hosts)
    assert [type(a) for a in actions] == [Place] and actions[0].host in ("h3", "h4")
    starting = replica(actions[0].host, new.template.hash, ReplicaState.STARTING)
    actions, status = run(new, [*old_replicas, starting], hosts, status)
    assert actions == []  # max_surge 1 used, max_unavailable 0: wait for the new one
    ready = replica(starting.host, new.template.hash)
    actions, status = run(new, [*old_replicas, ready], hosts, status)
    retired = [a for a in actions if isinstance(a, Retire)]
    assert len(retired) == 1 and not retired[0].force and "rollout" in retired[0].reason


def test_a_rollout_counts_a_draining_replica_against_the_surge_until_it_is_gone() -> None:
    old = deployment(2, artifact="a" * 64)
    new = deployment(2, artifact="b" * 64, generation=2)
    hosts = [host("h1"), host("h2"), host("h3"), host("h4")]
    draining = replica("h1", old.template.hash, ReplicaState.DRAINING)
    serving = [replica("h2", old.template.hash), replica("h3", new.template.hash)]
    actions, status = run(new, [draining, *serving], hosts)
    assert actions == []  # 2 replicas + 1 surge held: the next one waits for the teardown
    actions, status = run(new, serving, hosts, status)
    assert [a.host for a in actions if isinstance(a, Place)] == ["h1"]


def test_a_host_entering_the_quads_window_is_replaced_before_its_replica_is_taken_away() -> None:
    dep = deployment(1)
    soon = QuadsWindow(state="reserved", conflict_at=NOW + timedelta(hours=2), describe="cloud03")
    hosts = [host("h1", quads=soon, occupant=Occupant("node", "replica", deployment="coder")), host("h2")]
    serving = replica("h1", dep.template.hash)
    actions, status = run(dep, [serving], hosts)
    assert actions == [Place("h2", dep.template, "rollout")]
    actions, status = run(dep, [serving, replica("h2", dep.template.hash, ReplicaState.STARTING)], hosts, status)
    assert actions == []
    actions, status = run(dep, [serving, replica("h2", dep.template.hash)], hosts, status)
    assert actions == [Retire("h1", "QUADS takes its host back", force=False)]


def test_a_rollout_whose_replicas_keep_failing_pauses_and_the_old_replicas_keep_serving() -> None:
    old = deployment(1, artifact="a" * 64)
    new = deployment(1, artifact="b" * 64, generation=2)
    hosts = [host("h1"), host("h2"), host("h3"), host("h4")]
    serving = replica("h1", old.template.hash)
    status = None
    for attempt, h in enumerate(("h2", "h3")):
        failed = replica(
            h,
            new.template.hash,
            ReplicaState.FAILED,
            reason="starting_engine: exit 1",
            failed_at=NOW + timedelta(seconds=attempt),
        )
        actions, status = run(new, [serving, failed], hosts, status, NOW + timedelta(seconds=attempt + 1))
    assert status.rollout.paused and "starting_engine: exit 1" in (status.rollout.reason or "")
    assert not any(isinstance(a, Place) for a in actions)
    assert not any(isinstance(a, Retire) and a.host == "h1" for a in actions)
    assert status.condition("Progressing").reason == "RolloutPaused"


def test_setups_cut_by_their_gateways_death_count_against_neither_the_rollout_nor_the_host() -> None:
    old = deployment(1, artifact="a" * 64)
    new = deployment(1, artifact="b" * 64, generation=2)
    hosts = [host("h1"), host("h2"), host("h3")]
    serving = replica("h1", old.template.hash)
    status = None
    for attempt in range(2):  # CONFIG pauses a rollout at 2 failures
        cut = ObservedReplica(
            host="h2",
            template=new.template.hash,
            state=ReplicaState.FAILED,
            reason="preflight: The gateway gw1:8080 stopped during step preflight (its host lease expired)",
            failed_at=NOW + timedelta(seconds=attempt),
            registered=False,
            interrupted=True,
        )
        actions, status = run(new, [serving, cut], hosts, status, NOW + timedelta(seconds=attempt + 1))
    assert not status.rollout.paused and status.rollout.failures == 0
    assert "h2" not in status.host_failures
    assert [a.host for a in actions if isinstance(a, Place)] == ["h2"]


def test_scale_down_takes_the_replica_quads_wants_back_soonest_first() -> None:
    dep = deployment(1)
    h = dep.template.hash
    later = QuadsWindow(state="free")
    hosts = [host("h1", quads=later), host("h2")]
    actions, _ = run(dep, [replica("h1", h), replica("h2", h)], hosts)
    # Neither is in the window; with no QUADS date the order is by name: the earliest conflict goes first.
    assert actions == [Retire("h1", "scaled down to 1", force=False)]


def test_deleting_retires_every_replica_then_removes_the_record() -> None:
    dep = deployment(2).model_copy(update={"deleting": True})
    h = dep.template.hash
    actions, _ = run(
        dep, [replica("h1", h), replica("h2", h, ReplicaState.FAILED, failed_at=NOW)], [host("h1"), host("h2")]
    )
    assert {a.host for a in actions if isinstance(a, Retire)} == {"h1", "h2"}
    actions, _ = run(dep, [], [host("h1"), host("h2")])
    assert actions == [RemoveDeployment()]


def test_a_replica_whose_teardown_failed_is_forgotten() -> None:
    dep = deployment(1)
    gone = ObservedReplica(host="h1", template=dep.template.hash, state=ReplicaState.TERMINATING, teardown_failed=True)
    actions, _ = run(dep, [gone], [host("h1"), host("h2")])
    assert actions[0] == Forget("h1", "its teardown failed; the host cannot be reached")


def test_a_deployment_no_host_can_hold_is_degraded_with_each_hosts_reason() -> None:
    dep = deployment(1, placement={"gpu_product": "*H100*"})
    actions, status = run(dep, [], [host("h1"), host("h2", 8)])
    assert actions == []
    degraded = status.condition("Degraded")
    assert degraded.status and degraded.reason == "NoFittingHost"
    assert all("does not match placement.gpu_product" in c.reasons[0] for c in status.explain.hosts)
    assert [e.kind for e in status.events] == ["unplaceable"]
    _, again = run(dep, [], [host("h1"), host("h2", 8)], status)
    assert [e.kind for e in again.events] == ["unplaceable"]  # said once, not every pass

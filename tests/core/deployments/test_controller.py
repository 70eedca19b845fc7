"""The controller's loop over an in-memory fleet: one leader per state directory (another takes over when it
resigns or dies), statuses written only when they change, refusals said once, autoscaled counts applied."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from qiip_core import HostBusy
from qiip_core.deployments import (
    Demand,
    Deployment,
    DeploymentController,
    FileLeadership,
    Fit,
    GpuView,
    HostView,
    ReconcileConfig,
    ReplicaState,
    ResolvedSource,
    Template,
    parse_spec,
)
from qiip_core.planner import DeviceMemory
from tests.support.deployments import InMemoryDeploymentStore, InMemoryFleet


def fits(template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
    return Fit(True, "fits", used_mib=1, total_mib=sum(d.total_mib for d in devices))


def hosts(n: int) -> list[HostView]:
    return [HostView(name=f"h{i}", origin="config", gpus=(GpuView(0, "NVIDIA L4", 23_034),)) for i in range(n)]


def a_deployment(name: str = "coder", replicas: int = 2, **spec: object) -> Deployment:
    parsed = parse_spec({"name": name, "source": {"artifact": "aaaaaaaa"}, "replicas": replicas, **spec})
    return Deployment(spec=parsed, template=Template(engine="llama_cpp", source=ResolvedSource(model="m.gguf")))


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def controller(
    store: InMemoryDeploymentStore, fleet: InMemoryFleet, leadership: FileLeadership, clock: Clock, **kw: object
) -> DeploymentController:
    return DeploymentController(
        store=store,
        observer=fleet,
        actuator=fleet,
        leadership=leadership,
        config=ReconcileConfig(),
        clock=clock,
        **({"fit": fits} | kw),  # type: ignore[arg-type]
    )


async def test_only_the_leader_acts_and_another_takes_over_when_it_resigns(tmp_path: Path) -> None:
    store, fleet, clock = InMemoryDeploymentStore(), InMemoryFleet(hosts(4)), Clock()
    await store.write(a_deployment(), expected_generation=None)
    first = controller(store, fleet, FileLeadership(tmp_path, "gw-a:8080"), clock)
    second = controller(store, fleet, FileLeadership(tmp_path, "gw-b:8080"), clock)
    assert await first.tick() and not await second.tick()
    assert second.leadership.leader == "gw-a:8080"
    assert len(fleet.replicas) == 2
    await first.aclose()
    assert await second.tick()
    assert second.leadership.token == first.leadership.token + 1 or second.leadership.token > 0
    assert len(fleet.replicas) == 2  # the new leader sees the same replicas and places nothing more


def test_a_leader_killed_with_sigkill_frees_the_lease_for_another_gateway(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from qiip_core.deployments import "
         "FileLeadership; import asyncio; l = FileLeadership(Path(sys.argv[1]), 'gw-a'); "
         "assert asyncio.run(l.campaign()); print('leading', flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == b"leading\n"
    import asyncio

    other = FileLeadership(tmp_path, "gw-b")
    assert not asyncio.run(other.campaign())
    holder.kill()
    holder.wait()
    holder.stdout.close()
    assert asyncio.run(other.campaign()) and other.token == 2


async def test_a_pass_that_changes_nothing_writes_no_status_and_a_refusal_is_said_once(tmp_path: Path) -> None:
    store, fleet, clock = InMemoryDeploymentStore(), InMemoryFleet(hosts(3)), Clock()
    await store.write(a_deployment(replicas=1), expected_generation=None)
    ctl = controller(store, fleet, FileLeadership(tmp_path, "gw"), clock)
    await ctl.tick()
    fleet.advance()
    await ctl.tick()
    written = store.status_records["coder"]
    clock.now += timedelta(seconds=2)
    await ctl.tick()
    assert store.status_records["coder"] is written  # nothing changed: not rewritten

    async def busy(deployment: Deployment, host: str, template: Template) -> None:
        raise HostBusy(f"Host {host} is busy", host=host)

    fleet.place = busy  # type: ignore[method-assign]
    await ctl.store.write(a_deployment(replicas=2), expected_generation=None)
    for _ in range(3):
        clock.now += timedelta(seconds=2)
        await ctl.tick()
    waiting = [e for e in store.status_records["coder"].events if e.kind == "waiting"]
    assert len(waiting) == 1 and "is busy" in waiting[0].message


async def test_an_active_autoscaler_sets_the_count_the_controller_holds(tmp_path: Path) -> None:
    store, fleet, clock = InMemoryDeploymentStore(), InMemoryFleet(hosts(4)), Clock()
    autoscale = {"min": 1, "max": 3, "target": 1.0, "up_window_s": 0, "cooldown_s": 0, "mode": "active"}
    await store.write(a_deployment(replicas=1, autoscale=autoscale), expected_generation=None)
    load = {"coder": Demand(in_flight=6, slots=2)}

    async def demand(names: Sequence[str]) -> dict[str, Demand]:
        return load

    ctl = controller(store, fleet, FileLeadership(tmp_path, "gw"), clock, demand=demand)
    await ctl.tick()
    fleet.advance()
    clock.now += timedelta(seconds=2)
    await ctl.tick()
    fleet.advance()
    status = store.status_records["coder"]
    assert status.autoscale.desired == 3 and status.desired == 3
    assert sum(1 for r in fleet.replicas.values() if r.state is ReplicaState.READY) == 3
    assert any(e.kind == "scaled" and "1 → 3" in e.message for e in status.events)


async def test_a_controller_taking_over_continues_the_autoscalers_windows_without_a_burst(tmp_path: Path) -> None:
    store, fleet, clock = InMemoryDeploymentStore(), InMemoryFleet(hosts(4)), Clock()
    autoscale = {"min": 1, "max": 3, "target": 1.0, "up_window_s": 30, "cooldown_s": 60, "mode": "active"}
    await store.write(a_deployment(replicas=1, autoscale=autoscale), expected_generation=None)

    async def demand(names: Sequence[str]) -> dict[str, Demand]:
        return {"coder": Demand(in_flight=6, slots=2)}

    first = controller(store, fleet, FileLeadership(tmp_path, "gw-a"), clock, demand=demand)
    await first.tick()
    fleet.advance()
    for _ in range(2):  # 20 s above target: not yet the 30 s window
        clock.now += timedelta(seconds=10)
        await first.tick()
    assert store.status_records["coder"].desired == 1
    await first.aclose()  # the leader goes; another gateway's controller takes over with what the status holds
    second = controller(store, fleet, FileLeadership(tmp_path, "gw-b"), clock, demand=demand)
    clock.now += timedelta(seconds=11)
    assert await second.tick()
    for _ in range(5):  # more passes within the cooldown: no further step
        fleet.advance()
        clock.now += timedelta(seconds=2)
        await second.tick()
    status = store.status_records["coder"]
    assert status.desired == 3, status.autoscale.reason
    assert [e.message.split(" (")[0] for e in status.events if e.kind == "scaled"] == ["autoscaler: 1 → 3 replicas"]


def sized(template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
    total = sum(d.total_mib for d in devices)
    if total < 40_000:
        return Fit(False, f"needs 40,000 MiB, has {total:,}")
    return Fit(True, "2 slot(s)", used_mib=30_000, total_mib=total)


class Batched:
    """A fit check that proves questions together (`BatchFitCheck`), counting how it is asked."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, tuple[DeviceMemory, ...]], Fit] = {}
        self.batches: list[int] = []
        self.one_by_one = 0
        """Questions proven when asked, not together."""

    def __call__(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
        key = (template.hash, devices)
        if key not in self.known:
            self.one_by_one += 1
            self.known[key] = sized(template, devices)
        return self.known[key]

    def proven(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit | None:
        return self.known.get((template.hash, devices))

    def prove_all(self, questions: Iterable[tuple[Template, tuple[DeviceMemory, ...]]]) -> int:
        asked = {(t.hash, d): sized(t, d) for t, d in questions}
        self.batches.append(len(asked))
        self.known.update(asked)
        return len(asked)


def mixed_hosts() -> list[HostView]:
    small = [HostView(name=f"s{i}", origin="config", gpus=(GpuView(0, "NVIDIA L4", 23_034),)) for i in range(4)]
    big = [HostView(name=f"b{i}", origin="config", gpus=(GpuView(0, "NVIDIA A100", 81_920),)) for i in range(4)]
    return small + big


async def test_a_pass_proves_every_new_question_together_and_decides_as_one_asking_one_by_one(tmp_path: Path) -> None:
    runs = []
    for name, fit in (("together", Batched()), ("one by one", sized)):
        store, fleet, clock = InMemoryDeploymentStore(), InMemoryFleet(mixed_hosts()), Clock()
        for deployment in (a_deployment("chat", 2), a_deployment("coder", 1, source={"artifact": "bbbbbbbb"})):
            await store.write(deployment, expected_generation=None)
        ctl = controller(store, fleet, FileLeadership(tmp_path / name, "gw"), clock, fit=fit)
        await ctl.tick()
        runs.append((fit, fleet, store))
    (batched, fleet, store), (_, plain_fleet, plain_store) = runs
    assert isinstance(batched, Batched)
    assert batched.batches == [2]  # one template (both deployments name one model) × two host shapes, together
    assert batched.one_by_one == 0  # and the pass decided again from those proofs alone
    assert sorted(fleet.replicas) == sorted(plain_fleet.replicas) == ["b0", "b1", "b2"]
    for name in ("chat", "coder"):
        assert store.status_records[name] == plain_store.status_records[name]
    explain = store.status_records["chat"].explain
    assert explain is not None and len(explain.hosts) == 8
    ctl = controller(store, fleet, FileLeadership(tmp_path / "together", "gw"), Clock(), fit=batched)
    fleet.advance()
    await ctl.tick()  # a steady pass: nothing new to prove, decided once
    assert batched.batches == [2] and batched.one_by_one == 0

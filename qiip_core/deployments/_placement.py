"""Placement: which hosts of the pool a deployment's new replicas go to, and why every other host did not.

Filter, then score, then choose, as GPUStack's and Kubernetes' schedulers do; pure functions over `HostView`s:

```
filters (each failure is a reason the explain shows)          scores of a host that passed every filter
  placement.hosts, placement.labels                             +30  the engine is already installed there
  free: no node, no operation, no replica of this deployment    +20  the model is already served there
  QUADS: not broken or retired, no reservation in the window    +20  tightest fit (binpack: used / total)
  no recent failed replica (backoff)                            +20  llmfit's score of the model there
  engine: vLLM needs an NVIDIA GPU                              + 5  not a QUADS-lent host (it stays)
  placement.gpu_product, placement.min_gpu_memory_mib
  fit: the planner proves the runtime fits the host's live or declared memory — never "it will probably fit"
```

A replica is one host: each host serves one node at the provisioning engine port, so spreading over hosts is
given. Ties go to the host name, so a placement is the same for the same inputs.

Every host is explained, and at 10,000 hosts that is the cost: the filters, the planner and the score are asked
once per group of hosts alike in what they read (`HostPool.groups`), and a group's answer is one run of records
its hosts share with every deployment that weighs them alike; only a host something holds or this pass took is
weighed on its own.
"""

from __future__ import annotations

import fnmatch
import functools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import chain, islice
from typing import Protocol, runtime_checkable

from qiip_core.deployments._hosts import HostPool, HostView
from qiip_core.deployments._resource import Deployment, HostChoice, HostFailure, PlacementExplain, Template
from qiip_core.nodes import Engine
from qiip_core.planner import DeviceMemory

__all__ = ["BatchFitCheck", "Fit", "FitCheck", "PlacementInput", "host_devices", "place"]

_CPU_DEVICE = "CPU (system memory)"


@dataclass(frozen=True)
class Fit:
    """Whether a template fits a host's devices, as the planner says."""

    ok: bool
    """Whether it fits."""
    reason: str
    """Why not (the planner's words), or what the replica would run (`4 slots × 8,192 tokens, f16 K/V`)."""
    used_mib: float = 0.0
    """Memory the replica would use, over every device, in MiB."""
    total_mib: float = 0.0
    """Memory of those devices, in MiB."""
    slots: int = 0
    """Sequences the replica serves at once (llama.cpp slots, `--parallel`); 0 when unknown (vLLM)."""
    context_per_slot: int = 0
    """Tokens of context each slot holds (`n_ctx / n_parallel`); 0 when unknown."""


FitCheck = Callable[[Template, tuple[DeviceMemory, ...]], Fit]
"""Plans `template` on the devices and says whether it fits (`PlannerFit` shares each proof by what it is
computed from; `place` asks once per host shape)."""


@runtime_checkable
class BatchFitCheck(Protocol):
    """A `FitCheck` that tells what it has proven without proving it, and proves many questions at once
    (`PlannerFit`): the controller notes every question a pass asks before it decides (`DeploymentController`)."""

    def __call__(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
        """Whether `template` fits `devices`, proven now if need be (never raises; see `Fit`)."""
        ...

    def proven(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit | None:
        """The proof if it is made already, else None (proving nothing)."""
        ...

    def prove_all(self, questions: Iterable[tuple[Template, tuple[DeviceMemory, ...]]]) -> int:
        """Prove every question not proven yet, together; returns the proofs made."""
        ...


@dataclass(frozen=True)
class PlacementInput:
    """What a placement is decided from, besides the hosts."""

    now: datetime
    """The current time (aware, UTC)."""
    cpu_profile: bool
    """Whether replicas run on the host CPU (`provisioning.profile = "cpu"`): plans use the host's RAM."""
    host_failures: Mapping[str, HostFailure]
    """Hosts to avoid until their backoff ends."""
    holding: frozenset[str]
    """Hosts that hold a replica of this deployment already."""
    busy: Mapping[str, str] = field(default_factory=dict)
    """Hosts this pass placed a replica of another deployment on, by host: the deployment's name."""


def host_devices(host: HostView, *, cpu_profile: bool) -> tuple[DeviceMemory, ...] | str:
    """The devices a replica on `host` is planned on, or why there are none.

    Args:
        host: the host.
        cpu_profile: plan on the host's RAM (one CPU device) instead of its GPUs.

    Returns:
        The devices (GPUs in index order, with their free memory; a declared GPU counts as empty), or a sentence
        saying why the host cannot be planned for.
    """
    if cpu_profile:
        if host.memory_mib is None:
            return "its memory is unknown: declare memory_mib for it ([[hosts]] or qiip host add --memory-mib)"
        return (
            DeviceMemory(index=0, name=_CPU_DEVICE, total_mib=host.memory_mib, free_mib=host.memory_mib, kind="cpu"),
        )
    if not host.gpus:
        return "it has no known NVIDIA GPU"
    devices = []
    for gpu in host.gpus:
        if gpu.memory_total_mib is None:
            return (
                f"the memory of its GPU {gpu.product} is unknown (QUADS lists no memory): declare it with "
                "qiip host add --gpu, or run qiip agent there"
            )
        free = gpu.memory_free_mib if gpu.memory_free_mib is not None else gpu.memory_total_mib
        devices.append(
            DeviceMemory(
                index=gpu.index,
                name=gpu.product,
                total_mib=gpu.memory_total_mib,
                free_mib=min(free, gpu.memory_total_mib),
            )
        )
    return tuple(devices)


def _shared_reasons(
    deployment: Deployment, host: HostView, *, cpu_profile: bool, quads_free_for_s: float
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The reasons to refuse `host` that every host of its group (`HostPool.groups`) shares, in three parts that
    the explain's order puts around the host's own (`_held` after the first, `_failed` after the second): its
    name and labels; QUADS; the engine, GPU product and GPU memory."""
    placement = deployment.spec.placement
    named: list[str] = []
    if not host.matches(placement.hosts):
        named.append(f"its name does not match placement.hosts ({', '.join(placement.hosts)})")
    for key, value in placement.labels.items():
        have = host.labels.get(key)
        if have is None:
            named.append(f"it has no label {key} (placement.labels wants {key}={value})")
        elif have != value:
            named.append(f"its label {key} is {have!r}, placement.labels wants {value!r}")
    quads: tuple[str, ...] = ()
    if host.quads is not None and host.quads.state != "free":
        if host.quads.state in ("broken", "retired"):
            quads = (f"QUADS marks it {host.quads.state}",)
        else:
            when = host.quads.conflict_at.strftime("%Y-%m-%d %H:%M UTC") if host.quads.conflict_at else "now"
            hours = quads_free_for_s / 3600
            quads = (
                f"QUADS reserves it from {when} for {host.quads.describe or 'another tenant'} "
                f"(inside the {hours:g} h it must stay free)",
            )
    devices: list[str] = []
    if deployment.spec.engine is Engine.VLLM and not host.gpus and not cpu_profile:
        devices.append("vLLM needs an NVIDIA GPU and none is known there")
    if placement.gpu_product is not None:
        wrong = [g.product for g in host.gpus if not fnmatch.fnmatch(g.product.lower(), placement.gpu_product.lower())]
        if not host.gpus:
            devices.append(f"no GPU is known there (placement.gpu_product is {placement.gpu_product})")
        elif wrong:
            devices.append(f"its GPU {wrong[0]} does not match placement.gpu_product ({placement.gpu_product})")
    if placement.min_gpu_memory_mib is not None:
        small = [
            g for g in host.gpus if g.memory_total_mib is None or g.memory_total_mib < placement.min_gpu_memory_mib
        ]
        if not host.gpus:
            devices.append(f"no GPU is known there (placement.min_gpu_memory_mib is {placement.min_gpu_memory_mib:,})")
        elif small:
            have = "unknown" if small[0].memory_total_mib is None else f"{small[0].memory_total_mib:,} MiB"
            devices.append(
                f"its GPU memory ({have}) is below placement.min_gpu_memory_mib ({placement.min_gpu_memory_mib:,})"
            )
    return tuple(named), quads, tuple(devices)


@functools.lru_cache(maxsize=4096)
def _held(kind: str, what: str) -> tuple[str, ...]:
    """Why a host is taken (the same words for every deployment, so made once): `holds` a replica of this
    deployment, `busy` with an occupant (`what`: `Occupant.describe`), or `placing` another (`what`: its name)."""
    if kind == "holds":
        return ("it holds a replica of this deployment already",)
    if kind == "busy":
        return (f"it is busy: {what}",)
    return (f"a replica of {what!r} is being placed there",)


def _failed(host: HostView, given: PlacementInput) -> tuple[str, ...]:
    """A replica that failed on `host` recently, while its backoff lasts."""
    failure = given.host_failures.get(host.name)
    if failure is None or failure.until <= given.now:
        return ()
    return (
        f"a replica failed there at {failure.at.strftime('%H:%M:%S UTC')} ({failure.reason}); "
        f"avoided until {failure.until.strftime('%H:%M:%S UTC')}",
    )


def _packing(fit: Fit) -> tuple[float, str] | None:
    """The tightest-fit part of a score: the same for every host of one shape, so made once per shape."""
    if fit.total_mib <= 0:
        return None
    packing = 20.0 * min(1.0, fit.used_mib / fit.total_mib)
    return packing, f"uses {fit.used_mib:,.0f} of {fit.total_mib:,.0f} MiB ({fit.reason})"


def _score(template: Template, host: HostView, packing: tuple[float, str] | None) -> tuple[float, list[str]]:
    parts: list[tuple[float, str]] = []
    if template.engine in host.engines:
        parts.append((30.0, f"{template.engine} is installed there"))
    if template.source.model in host.models:
        parts.append((20.0, "it served this model before"))
    if packing is not None:
        parts.append(packing)
    if host.llmfit_score is not None:
        parts.append((0.2 * max(0.0, min(100.0, host.llmfit_score)), f"llmfit scores it {host.llmfit_score:.0f}"))
    if host.origin != "quads":
        parts.append((5.0, "not lent by QUADS"))
    score = round(sum(p for p, _ in parts), 3)
    return score, [f"+{p:.1f} {why}" for p, why in parts]


def _plan_shape(
    template: Template, host: HostView, given: PlacementInput, fit: FitCheck
) -> tuple[str | None, tuple[float, str] | None]:
    """Plan `template` on the devices of `host`'s shape: why not (None: it fits), and its packing part."""
    devices = host_devices(host, cpu_profile=given.cpu_profile)
    if isinstance(devices, str):
        return f"it cannot be planned for: {devices}", None
    result = fit(template, devices)
    if not result.ok:
        return f"the planner says it does not fit: {result.reason}", None
    return None, _packing(result)


def place(
    deployment: Deployment,
    hosts: HostPool | Sequence[HostView],
    *,
    wanted: int,
    given: PlacementInput,
    fit: FitCheck,
    quads_free_for_s: float,
) -> tuple[list[str], PlacementExplain]:
    """Choose hosts for `wanted` new replicas of the deployment's current template.

    Every host is weighed and explained, but not one by one: the hosts of one group (`HostPool.groups`: alike in
    every field a filter or score reads but the name) are filtered and scored once, the planner is asked once per
    host shape, and the group's free hosts share the answer and one run of records. A host something holds, or
    that this deployment holds, failed on or this pass placed another replica on, is explained on its own: its
    group's reasons with its own among them, in the same order as for any host.

    Args:
        deployment: the deployment.
        hosts: every host of the pool, as observed now (a `HostPool` brings its shapes, made once per pass).
        wanted: how many replicas to place.
        given: the time, the profile, the hosts to avoid and those holding a replica already.
        fit: the planner's check of the template on a host's devices.
        quads_free_for_s: how long QUADS must leave a host free (for the explain's wording; the window is
            already applied in each `HostView.quads`).

    Returns:
        The chosen host names (at most `wanted`, best first) and the explain of every host: the chosen, then the
        other eligible hosts by score (ties by name), then the refused by name.
    """
    pool = hosts if isinstance(hosts, HostPool) else HostPool.of(hosts)
    if len(pool.shapes) != len(pool.hosts):
        pool = HostPool.of(pool.hosts)
    template, placement = deployment.template, deployment.spec.placement
    grouping = (tuple(placement.labels), placement.hosts)
    groups = pool.groups(*grouping)
    made = pool.choices

    def choice(name: str, ok: bool, reasons: tuple[str, ...], score: float | None, on: bool) -> HostChoice:
        key = (name, ok, reasons, score, on)
        found = made.get(key)
        if found is None:
            found = made[key] = HostChoice(host=name, eligible=ok, reasons=reasons, score=score, chosen=on)
        return found

    shared: dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}

    def shared_reasons(group: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        found = shared.get(group)
        if found is None:
            host = pool.hosts[groups.first[group]]
            found = shared[group] = _shared_reasons(
                deployment, host, cpu_profile=given.cpu_profile, quads_free_for_s=quads_free_for_s
            )
        return found

    planned: dict[int, tuple[str | None, tuple[float, str] | None]] = {}
    scored: dict[tuple[int, bool, bool, float | None, bool], tuple[float, tuple[str, ...]]] = {}

    def answer(group: int) -> _Answer:
        """What a free host of `group` is told: eligible or not, the reasons (or the score's words), the score."""
        named, quads, devices = shared_reasons(group)
        reasons = named + quads + devices
        if reasons:
            return False, reasons, None
        first = groups.first[group]
        host, shape = pool.hosts[first], pool.shapes[first]
        found = planned.get(shape)
        if found is None:
            found = planned[shape] = _plan_shape(template, host, given, fit)
        refusal, packing = found
        if refusal is not None:
            return False, (refusal,), None
        # Groups that differ in nothing the score reads (labels, say) share one score and its words.
        alike = (
            shape,
            template.engine in host.engines,
            template.source.model in host.models,
            host.llmfit_score,
            host.origin != "quads",
        )
        score = scored.get(alike)
        if score is None:
            value, parts = _score(template, host, packing)
            score = scored[alike] = (value, tuple(parts))
        return True, score[1], score[0]

    def run(answered: list[tuple[int, _Answer]]) -> tuple[tuple[HostChoice, ...], tuple[int, ...]]:
        """The records of the free hosts of the groups `answered`, in name order, with their positions."""
        key = (grouping, tuple(answered))
        found = pool.runs.get(key)
        if found is None:
            if len(answered) == 1:
                group, (ok, reasons, score) = answered[0]
                positions = groups.free[group]
                found = (tuple(choice(pool.hosts[p].name, ok, reasons, score, False) for p in positions), positions)
            else:  # merged by position from each group's own run
                pairs = sorted(pair for one in answered for pair in zip(*reversed(run([one])), strict=True))
                found = (tuple(r for _, r in pairs), tuple(p for p, _ in pairs))
            pool.runs[key] = found
        return found

    # The hosts explained on their own: held by something, or by this deployment, this pass or a recent failure.
    index, occupied, holding, busy = pool.index, pool.occupied, given.holding, given.busy
    failures = {n for n, f in given.host_failures.items() if f.until > given.now}
    own = {index[name] for name in chain(holding, busy, failures) if name in index} - occupied
    own_in: dict[int, list[int]] = {}
    for position in own:
        own_in.setdefault(groups.of[position], []).append(position)
    eligible_groups: dict[float, list[tuple[int, _Answer]]] = {}
    refused_groups: list[tuple[int, _Answer]] = []
    for group, free in enumerate(groups.free):
        if len(free) <= len(own_in.get(group, ())):
            continue  # no free host of the group left to this deployment: the planner is not asked for it
        said = answer(group)
        score = said[2]
        if score is not None:
            eligible_groups.setdefault(score, []).append((group, said))
        else:
            refused_groups.append((group, said))
    alone: list[tuple[int, HostChoice | None]] = []
    for position in sorted(own | occupied):
        host = pool.hosts[position]
        name = host.name
        group = groups.of[position]
        named, quads, devices = shared[group] if group in shared else shared_reasons(group)
        if name in holding:
            held = _held("holds", "")
        elif host.occupant is not None:
            held = _held("busy", host.occupant.describe)
        else:
            held = _held("placing", busy[name]) if name in busy else ()
        failed = _failed(host, given) if name in failures else ()
        reasons = named + held + quads + failed + devices if named or quads or failed or devices else held
        alone.append((position, choice(name, False, reasons, None, False)))
    eligible: list[HostChoice] = []
    for score in sorted(eligible_groups, reverse=True):
        answered = eligible_groups[score]
        taken = sorted(p for group, _ in answered for p in own_in.get(group, ()))
        eligible += _splice(*run(answered), [(p, None) for p in taken])
    top = max(0, wanted)
    picked = [choice(c.host, True, c.reasons, c.score, True) for c in eligible[:top]]
    refused = _splice(*run(refused_groups), alone)
    explained = tuple(chain(picked, islice(eligible, top, None), refused))
    explain = PlacementExplain(at=given.now, template=template.hash, wanted=wanted, hosts=explained)
    return [c.host for c in picked], explain


_Answer = tuple[bool, tuple[str, ...], float | None]
"""What the free hosts of a group are told: eligible or not, the reasons (or the score's words), the score."""


def _splice(
    records: Sequence[HostChoice], positions: Sequence[int], changes: Sequence[tuple[int, HostChoice | None]]
) -> list[HostChoice]:
    """`records` (of the hosts at `positions`, ascending) with each change made where its position falls: its
    record replaces the one there or is inserted, or None removes the one there. `changes` ascend too."""
    out: list[HostChoice] = []
    start = 0
    for position, record in changes:
        at = bisect_left(positions, position, start)
        out += records[start:at]
        if at < len(positions) and positions[at] == position:
            at += 1
        if record is not None:
            out.append(record)
        start = at
    out += records[start:]
    return out

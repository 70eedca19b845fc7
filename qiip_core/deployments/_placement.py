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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from qiip_core.deployments._hosts import HostPool, HostView
from qiip_core.deployments._resource import Deployment, HostChoice, HostFailure, PlacementExplain, Template
from qiip_core.nodes import Engine
from qiip_core.planner import DeviceMemory

__all__ = ["Fit", "FitCheck", "PlacementInput", "host_devices", "place"]

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


def _filters(deployment: Deployment, host: HostView, given: PlacementInput, quads_free_for_s: float) -> list[str]:
    spec = deployment.spec
    placement = spec.placement
    reasons: list[str] = []
    if not host.matches(placement.hosts):
        reasons.append(f"its name does not match placement.hosts ({', '.join(placement.hosts)})")
    for key, value in placement.labels.items():
        have = host.labels.get(key)
        if have is None:
            reasons.append(f"it has no label {key} (placement.labels wants {key}={value})")
        elif have != value:
            reasons.append(f"its label {key} is {have!r}, placement.labels wants {value!r}")
    if host.name in given.holding:
        reasons.append("it holds a replica of this deployment already")
    elif host.occupant is not None:
        reasons.append(f"it is busy: {host.occupant.describe}")
    elif host.name in given.busy:
        reasons.append(f"a replica of {given.busy[host.name]!r} is being placed there")
    if host.quads is not None and host.quads.state != "free":
        if host.quads.state in ("broken", "retired"):
            reasons.append(f"QUADS marks it {host.quads.state}")
        else:
            when = host.quads.conflict_at.strftime("%Y-%m-%d %H:%M UTC") if host.quads.conflict_at else "now"
            hours = quads_free_for_s / 3600
            reasons.append(
                f"QUADS reserves it from {when} for {host.quads.describe or 'another tenant'} "
                f"(inside the {hours:g} h it must stay free)"
            )
    failure = given.host_failures.get(host.name)
    if failure is not None and failure.until > given.now:
        reasons.append(
            f"a replica failed there at {failure.at.strftime('%H:%M:%S UTC')} ({failure.reason}); "
            f"avoided until {failure.until.strftime('%H:%M:%S UTC')}"
        )
    if spec.engine is Engine.VLLM and not host.gpus and not given.cpu_profile:
        reasons.append("vLLM needs an NVIDIA GPU and none is known there")
    if placement.gpu_product is not None:
        wrong = [g.product for g in host.gpus if not fnmatch.fnmatch(g.product.lower(), placement.gpu_product.lower())]
        if not host.gpus:
            reasons.append(f"no GPU is known there (placement.gpu_product is {placement.gpu_product})")
        elif wrong:
            reasons.append(f"its GPU {wrong[0]} does not match placement.gpu_product ({placement.gpu_product})")
    if placement.min_gpu_memory_mib is not None:
        small = [
            g for g in host.gpus if g.memory_total_mib is None or g.memory_total_mib < placement.min_gpu_memory_mib
        ]
        if not host.gpus:
            reasons.append(f"no GPU is known there (placement.min_gpu_memory_mib is {placement.min_gpu_memory_mib:,})")
        elif small:
            have = "unknown" if small[0].memory_total_mib is None else f"{small[0].memory_total_mib:,} MiB"
            reasons.append(
                f"its GPU memory ({have}) is below placement.min_gpu_memory_mib ({placement.min_gpu_memory_mib:,})"
            )
    return reasons


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

    The filters run for every host; the planner is asked once per host shape (`HostPool.shapes`) among the hosts
    that pass them, and every host of that shape is explained with its answer.

    Args:
        deployment: the deployment.
        hosts: every host of the pool, as observed now (a `HostPool` brings its shapes, made once per pass).
        wanted: how many replicas to place.
        given: the time, the profile, the hosts to avoid and those holding a replica already.
        fit: the planner's check of the template on a host's devices.
        quads_free_for_s: how long QUADS must leave a host free (for the explain's wording; the window is
            already applied in each `HostView.quads`).

    Returns:
        The chosen host names (at most `wanted`, best first) and the explain of every host.
    """
    pool = hosts if isinstance(hosts, HostPool) else HostPool.of(hosts)
    if len(pool.shapes) != len(pool.hosts):
        pool = HostPool.of(pool.hosts)
    template = deployment.template
    planned: dict[int, tuple[str | None, tuple[float, str] | None]] = {}
    scored: dict[tuple[int, bool, bool, float | None, bool], tuple[float, tuple[str, ...]]] = {}
    eligible: list[tuple[float, str, tuple[str, ...]]] = []
    refused: list[tuple[str, tuple[str, ...]]] = []
    for host, shape in zip(pool.hosts, pool.shapes, strict=True):
        reasons = _filters(deployment, host, given, quads_free_for_s)
        if not reasons:
            answer = planned.get(shape)
            if answer is None:
                answer = planned[shape] = _plan_shape(template, host, given, fit)
            refusal, packing = answer
            if refusal is None:
                # Hosts of one shape that differ in nothing the score reads share one score and its words.
                alike = (
                    shape,
                    template.engine in host.engines,
                    template.source.model in host.models,
                    host.llmfit_score,
                    host.origin != "quads",
                )
                found = scored.get(alike)
                if found is None:
                    score, parts = _score(template, host, packing)
                    found = scored[alike] = (score, tuple(parts))
                eligible.append((found[0], host.name, found[1]))
                continue
            reasons.append(refusal)
        refused.append((host.name, tuple(reasons)))
    eligible.sort(key=lambda item: (-item[0], item[1]))
    chosen = [name for _, name, _ in eligible[: max(0, wanted)]]
    picked = set(chosen)
    made = pool.choices

    def choice(name: str, ok: bool, reasons: tuple[str, ...], score: float | None, on: bool) -> HostChoice:
        key = (name, ok, reasons, score, on)
        found = made.get(key)
        if found is None:
            found = made[key] = HostChoice(host=name, eligible=ok, reasons=reasons, score=score, chosen=on)
        return found

    choices = [choice(name, True, parts, score, name in picked) for score, name, parts in eligible]
    choices += [choice(name, False, reasons, None, False) for name, reasons in sorted(refused)]
    explain = PlacementExplain(at=given.now, template=template.hash, wanted=wanted, hosts=tuple(choices))
    return chosen, explain

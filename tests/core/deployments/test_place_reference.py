"""`place` weighing hosts by group against a plain copy of the code before (host by host): the same chosen hosts,
the same explain to the record, and the same questions to the planner, over random pools of every kind of host
(labels, QUADS windows, occupants, failures, this pass's placements, engines, models, llmfit scores, origins) and
deployments with every placement rule."""

from __future__ import annotations

import fnmatch
import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from qiip_core.deployments import (
    Deployment,
    Fit,
    FitCheck,
    GpuView,
    HostPool,
    HostView,
    Occupant,
    PlacementInput,
    QuadsWindow,
    ResolvedSource,
    Template,
    host_devices,
    parse_spec,
    place,
)
from qiip_core.deployments._resource import HostChoice, HostFailure, PlacementExplain
from qiip_core.nodes import Engine
from qiip_core.planner import DeviceMemory

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

# ---- the code before, copied whole (only `place` renamed, and its records kept to itself) -----------------------


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


def reference_place(
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
    pool = HostPool.of(hosts.hosts if isinstance(hosts, HostPool) else hosts)
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
    made: dict[tuple[str, bool, tuple[str, ...], float | None, bool], HostChoice] = {}

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


# ---- random pools and deployments ----------------------------------------------------------------------------

GPUS = [
    ("NVIDIA H100 80GB HBM3", 81_559, 8),
    ("NVIDIA A100-SXM4-80GB", 81_920, 4),
    ("NVIDIA L40S", 46_068, 2),
    ("Tesla T4", 15_360, 1),
]


def random_host(rng: random.Random, name: str) -> HostView:
    gpus: tuple[GpuView, ...] = ()
    kind = rng.randrange(len(GPUS) + 2)
    if kind < len(GPUS):
        product, memory, count = GPUS[kind]
        free = rng.choice([None, None, memory, memory // 2])  # live readings split a kind into shapes
        gpus = tuple(GpuView(g, product, memory, free) for g in range(count))
    elif kind == len(GPUS):  # QUADS lists the GPU, not its memory
        gpus = (GpuView(0, "NVIDIA A100-SXM4-80GB", None),)
    quads = rng.choice(
        [
            None,
            None,
            QuadsWindow("free"),
            QuadsWindow("reserved", NOW + timedelta(hours=2), "cloud02 (owner alice)"),
            QuadsWindow("reserved", None, ""),
            QuadsWindow("broken"),
            QuadsWindow("retired"),
        ]
    )
    occupant = rng.choice([None] * 6 + [Occupant("node", f"node {name} serving 'chat' (healthy)", "chat")])
    labels = {
        k: v
        for k, v in (("rack", rng.choice(["r1", "r2", "r3"])), ("zone", rng.choice(["a", "b"])))
        if rng.random() < 0.7
    }
    return HostView(
        name=name,
        origin=rng.choice(["config", "added", "quads"]),
        labels=labels,
        gpus=gpus,
        gpus_from="declared" if gpus else "none",
        memory_mib=rng.choice([None, 65_536, 262_144]),
        quads=quads,
        occupant=occupant,
        engines=frozenset(rng.choice([(), ("llama_cpp",), ("vllm",)])),
        models=frozenset(rng.choice([(), ("m/base.gguf",)])),
        llmfit_score=rng.choice([None, None, 42.0, 87.5]),
    )


def random_deployment(rng: random.Random, number: int) -> Deployment:
    placement: dict[str, object] = {}
    if rng.random() < 0.3:
        placement["hosts"] = rng.choice([["h0*"], ["h00?", "h01*"], ["h[1-2]*"]])
    if rng.random() < 0.4:
        placement["labels"] = rng.choice([{"rack": "r1"}, {"rack": "r2", "zone": "a"}, {"zone": "b"}])
    if rng.random() < 0.3:
        placement["gpu_product"] = rng.choice(["*A100*", "*h100*"])
    if rng.random() < 0.3:
        placement["min_gpu_memory_mib"] = rng.choice([40_000, 80_000])
    if rng.random() < 0.2:
        spec = parse_spec({"name": f"d{number}", "engine": "vllm", "source": {"hub": {"repo": "org/m"}}})
        source = ResolvedSource(model="org/m", artifact_id=f"{number:064x}")
    else:
        spec = parse_spec({"name": f"d{number}", "source": {"artifact": f"{number:08x}"}, "placement": placement})
        source = ResolvedSource(model=rng.choice(["m/base.gguf", "m/other.gguf"]), artifact_id=f"{number:064x}")
    return Deployment(spec=spec, template=Template(engine=spec.engine, source=source, runtime=spec.runtime))


def recording_fit(asked: list[tuple[str, tuple[DeviceMemory, ...]]]) -> FitCheck:
    def fit(template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
        asked.append((template.hash, devices))
        total = float(sum(d.total_mib for d in devices))
        free = sum(d.free_mib for d in devices)
        if free < 30_000:
            return Fit(False, f"needs 30,000 MiB, {free:,} free")
        return Fit(True, "2 slot(s) × 8,192 tokens, f16 K/V", used_mib=20_000.0 + len(devices), total_mib=total)

    return fit


def random_given(rng: random.Random, names: Sequence[str], cpu_profile: bool) -> PlacementInput:
    pick = [n for n in names if rng.random() < 0.1]
    failures = {
        n: HostFailure(
            at=NOW - timedelta(minutes=5), until=NOW + rng.choice([-1, 1]) * timedelta(minutes=3), reason="oom"
        )
        for n in names
        if rng.random() < 0.08
    }
    return PlacementInput(
        now=NOW,
        cpu_profile=cpu_profile,
        host_failures=failures,
        holding=frozenset(pick[: len(pick) // 2]),
        busy={n: f"other-{i}" for i, n in enumerate(pick[len(pick) // 2 :])},
    )


@pytest.mark.parametrize("seed", range(40))
def test_placing_by_group_chooses_and_explains_as_placing_host_by_host(seed: int) -> None:
    rng = random.Random(seed)
    names = [f"h{i:03d}" for i in range(rng.randint(1, 90))]
    rng.shuffle(names)
    hosts = [random_host(rng, name) for name in names]
    pool = HostPool.of(hosts)
    for number in range(6):  # several deployments over one pool: its shared records and runs are reused
        deployment = random_deployment(rng, number)
        given = random_given(rng, names, cpu_profile=rng.random() < 0.15)
        wanted = rng.randint(0, 4)
        asked_before: list[tuple[str, tuple[DeviceMemory, ...]]] = []
        asked_now: list[tuple[str, tuple[DeviceMemory, ...]]] = []
        before = reference_place(
            deployment, hosts, wanted=wanted, given=given, fit=recording_fit(asked_before), quads_free_for_s=7200.0
        )
        now = place(deployment, pool, wanted=wanted, given=given, fit=recording_fit(asked_now), quads_free_for_s=7200.0)
        assert now[0] == before[0]
        assert now[1].hosts == before[1].hosts
        assert now[1] == before[1]
        assert sorted(set(asked_now), key=repr) == sorted(set(asked_before), key=repr)
        assert len(asked_now) == len(asked_before)  # once per shape asked, as before


def plain(number: int) -> Deployment:
    spec = parse_spec({"name": f"p{number}", "source": {"artifact": f"{number:08x}"}})
    source = ResolvedSource(model="m/base.gguf", artifact_id=f"{number:064x}")
    return Deployment(spec=spec, template=Template(engine=spec.engine, source=source, runtime=spec.runtime))


def test_a_fleet_of_few_groups_is_explained_host_by_host_with_shared_records() -> None:
    hosts = [
        HostView(name=f"g{i:03d}", origin="config", gpus=(GpuView(0, "NVIDIA L40S", 46_068),), gpus_from="declared")
        for i in range(200)
    ]
    pool = HostPool.of(hosts)
    given = PlacementInput(now=NOW, cpu_profile=False, host_failures={}, holding=frozenset(), busy={"g007": "other"})
    asked: list[tuple[str, tuple[DeviceMemory, ...]]] = []
    first = place(
        plain(1),
        pool,
        wanted=2,
        given=given,
        fit=recording_fit(asked),
        quads_free_for_s=0.0,
    )
    second = place(
        plain(2),
        pool,
        wanted=2,
        given=given,
        fit=recording_fit(asked),
        quads_free_for_s=0.0,
    )
    assert first[0] == ["g000", "g001"] and len(first[1].hosts) == 200
    assert [c.host for c in first[1].hosts if not c.eligible] == ["g007"]
    # The second deployment's unchosen hosts are the very records of the first's.
    assert all(a is b for a, b in zip(first[1].hosts[2:], second[1].hosts[2:], strict=True))

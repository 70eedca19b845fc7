"""The planner's fit proofs, shared by proof input: hosts of one shape share one proof, hosts that differ in anything
the proof reads do not, and a changed input is never answered from an old proof."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qiip_core._errors import ModelFileError
from qiip_core.deployments import (
    Deployment,
    GpuView,
    HostPool,
    HostView,
    PlacementInput,
    PlannerFit,
    ResolvedSource,
    Template,
    parse_spec,
    place,
)
from qiip_core.planner import DeviceMemory, ModelShape

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
GIVEN = PlacementInput(now=NOW, cpu_profile=False, host_failures={}, holding=frozenset())


def llama(n_layers: int = 4, weights_mib: int = 1000) -> ModelShape:
    """A small llama-style model (4 blocks, 256 wide) of `weights_mib` MiB of weights."""
    return ModelShape(
        architecture="llama",
        n_layers=n_layers,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim_k=64,
        head_dim_v=64,
        n_ff=1024,
        n_ctx_train=8192,
        n_vocab=2000,
        weights_bytes=weights_mib << 20,
    )


def deployment(artifact: str = "a", *, context_tokens: int = 4096, name: str = "coder") -> Deployment:
    spec = parse_spec(
        {
            "name": name,
            "source": {"artifact": artifact * 12},
            "replicas": 1,
            "runtime": {"capacity": {"sequences": 2, "context_tokens": context_tokens}},
        }
    )
    template = Template(
        engine="llama_cpp",
        source=ResolvedSource(model=f"m/{artifact}.gguf", artifact_id=artifact * 64),
        runtime=spec.runtime,
    )
    return Deployment(spec=spec, template=template)


def gpus(*free_mib: int, product: str = "NVIDIA L40S", total_mib: int = 46_068) -> tuple[DeviceMemory, ...]:
    return tuple(DeviceMemory(index=i, name=product, total_mib=total_mib, free_mib=f) for i, f in enumerate(free_mib))


def host(name: str, *free_mib: int, **kwargs: Any) -> HostView:
    views = tuple(GpuView(i, "NVIDIA L40S", 46_068, f) for i, f in enumerate(free_mib))
    return HostView(name=name, origin="config", gpus=views, gpus_from="live", **kwargs)


class Reads:
    """A model cache that counts its reads and can be told a model is missing."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self.count = 0
        self.missing = False

    def __call__(self, template: Template) -> ModelShape:
        self.count += 1
        if self.missing:
            raise ModelFileError("the model is not in the shared cache", path=Path(template.source.model))
        return self.shape


def test_two_hosts_of_one_shape_share_one_proof_and_both_are_explained_with_it() -> None:
    fit = PlannerFit(Reads(llama()))
    pool = HostPool.of([host("gpu01", 46_068), host("gpu02", 46_068)])
    chosen, explain = place(deployment(), pool, wanted=1, given=GIVEN, fit=fit, quads_free_for_s=0)
    assert fit.proved == 1
    assert chosen == ["gpu01"]
    first, second = explain.hosts
    assert first.eligible and second.eligible and first.chosen and not second.chosen
    assert first.reasons == second.reasons
    assert any("slot(s)" in r for r in first.reasons)


def test_templates_of_one_model_shape_and_sizing_share_a_proof_and_another_sizing_does_not() -> None:
    fit = PlannerFit(Reads(llama()))
    devices = gpus(46_068)
    one, fine_tune = deployment("a").template, deployment("b").template
    assert fit(one, devices) == fit(fine_tune, devices)
    assert fit.proved == 1
    fit(deployment("c", context_tokens=8192).template, devices)
    assert fit.proved == 2


def test_hosts_that_differ_in_any_field_of_a_device_get_proofs_of_their_own() -> None:
    fit = PlannerFit(Reads(llama()))
    template = deployment().template
    base = gpus(46_068, 46_068)
    variants = [
        base,
        gpus(46_068, 40_000),  # free memory
        gpus(46_068, 46_068, total_mib=48_000),  # total memory
        gpus(46_068, 46_068, product="NVIDIA A40"),  # product
        (base[0], replace(base[1], index=3)),  # index
        gpus(46_068),  # count
        gpus(46_068, 46_068, 46_068),
    ]
    keys = {fit.key(template, devices) for devices in variants}
    assert len(keys) == len(variants)
    for devices in variants:
        fit(template, devices)
    assert fit.proved == len(variants)
    for devices in variants:  # asked again: every answer is served from its own proof
        fit(template, devices)
    assert fit.proved == len(variants)


def test_less_free_memory_is_a_new_proof_never_the_old_answer() -> None:
    fit = PlannerFit(Reads(llama(weights_mib=30_000)))
    template = deployment().template
    assert fit(template, gpus(46_068)).ok
    crowded = fit(template, gpus(20_000))
    assert not crowded.ok
    assert "20,000 MiB free" in crowded.reason
    assert fit(template, gpus(46_068)).ok


def test_a_pool_whose_host_changed_shape_is_planned_on_its_new_devices() -> None:
    fit = PlannerFit(Reads(llama(weights_mib=30_000)))
    dep = deployment()
    _, before = place(dep, HostPool.of([host("gpu01", 46_068)]), wanted=1, given=GIVEN, fit=fit, quads_free_for_s=0)
    _, after = place(dep, HostPool.of([host("gpu01", 20_000)]), wanted=1, given=GIVEN, fit=fit, quads_free_for_s=0)
    assert before.hosts[0].chosen
    assert not after.hosts[0].eligible
    assert "does not fit" in after.hosts[0].reasons[0]


def test_a_model_that_could_not_be_read_is_read_again_after_the_retry_delay() -> None:
    reads = Reads(llama())
    now = [100.0]
    fit = PlannerFit(reads, retry_after_s=30, clock=lambda: now[0])
    template, devices = deployment().template, gpus(46_068)
    reads.missing = True
    refused = fit(template, devices)
    assert not refused.ok and "cannot be read" in refused.reason
    reads.missing = False
    now[0] += 10
    assert not fit(template, devices).ok  # within the delay: the cache's word stands
    now[0] += 30
    assert fit(template, devices).ok
    assert reads.count == 2
    now[0] += 3600
    assert fit(template, devices).ok  # a model read once is not read again: its template pins its bytes
    assert reads.count == 2


def test_every_host_is_explained_when_shapes_share_proofs() -> None:
    fit = PlannerFit(Reads(llama(weights_mib=30_000)))
    hosts = [host(f"big{i}", 46_068) for i in range(3)] + [host(f"small{i}", 20_000) for i in range(3)]
    busy = host("busy", 46_068)
    pool = HostPool.of([*hosts, busy])
    given = replace(GIVEN, busy={"busy": "other"})
    chosen, explain = place(deployment(), pool, wanted=2, given=given, fit=fit, quads_free_for_s=0)
    assert fit.proved == 2
    assert chosen == ["big0", "big1"]
    by_host = {c.host: c for c in explain.hosts}
    assert len(by_host) == 7
    assert [by_host[f"big{i}"].chosen for i in range(3)] == [True, True, False]
    assert all(not by_host[f"small{i}"].eligible for i in range(3))
    assert all("does not fit" in by_host[f"small{i}"].reasons[0] for i in range(3))
    assert by_host["busy"].reasons == ("a replica of 'other' is being placed there",)


def vllm_template() -> Template:
    spec = parse_spec({"name": "served", "engine": "vllm", "source": {"hub": {"repo": "org/model"}}})
    return Template(engine="vllm", source=ResolvedSource(model="org/model"), runtime=spec.runtime)


def questions() -> list[tuple[Template, tuple[DeviceMemory, ...]]]:
    templates = [deployment("a").template, deployment("c", context_tokens=8192).template, deployment("b").template]
    shapes = [gpus(46_068), gpus(46_068, 46_068), gpus(20_000), gpus(500)]  # the last too small for the weights
    asked = [(t, d) for t in templates for d in shapes]
    return [*asked, *asked[:3], (vllm_template(), gpus(46_068))]  # repeated questions are one proof


def test_proofs_made_together_over_worker_processes_are_the_proofs_made_one_by_one() -> None:
    one_by_one = PlannerFit(Reads(llama(weights_mib=8_000)), size_of=lambda _t: 20 << 30)
    together = PlannerFit(
        Reads(llama(weights_mib=8_000)), size_of=lambda _t: 20 << 30, workers=3, min_parallel_layers=0
    )
    asked = questions()
    assert all(together.proven(t, d) is None for t, d in asked)
    made = together.prove_all(asked)
    answers = [one_by_one(t, d) for t, d in asked]
    assert made == one_by_one.proved == together.proved == 9  # 2 sizings × 4 shapes (a and b share one) + vLLM
    assert [together.proven(t, d) for t, d in asked] == answers
    assert [together(t, d) for t, d in asked] == answers
    assert together.proved == 9  # asked again: nothing proven twice
    assert together.prove_all(asked) == 0
    assert any(a.ok for a in answers) and any(not a.ok for a in answers)


def test_proofs_made_together_read_each_model_once_and_keep_a_model_that_cannot_be_read_short() -> None:
    reads = Reads(llama())
    reads.missing = True
    fit = PlannerFit(reads, workers=1)
    assert fit.prove_all(questions()[:-1]) == 12
    assert reads.count == 3  # once per template
    assert all("cannot be read" in fit(t, d).reason for t, d in questions()[:-1])

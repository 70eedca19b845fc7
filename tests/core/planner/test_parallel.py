"""Plans made over worker processes: the same answers as plans made here, one by one; a worker that dies leaves its
jobs to this process (no hang, no missing answer); a pool that cannot start, or one core, plans everything here;
a bug in a job is raised, not swallowed."""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys

import pytest

from qiip_core.planner import AutoPolicy, CustomPolicy, DeviceMemory, ModelShape, Plan, _parallel
from qiip_core.planner._parallel import PlanJob, plan_all, plan_job


def llama(n_layers: int, width: int, weights_mib: int, architecture: str = "llama") -> ModelShape:
    return ModelShape(
        architecture=architecture,
        n_layers=n_layers,
        n_embd=width,
        n_head=width // 64,
        n_head_kv=max(1, width // 256),
        head_dim_k=64,
        head_dim_v=64,
        n_ff=4 * width,
        n_ctx_train=16_384,
        n_vocab=4000,
        weights_bytes=weights_mib << 20,
    )


def gpus(count: int, free_mib: int, product: str = "NVIDIA L40S") -> tuple[DeviceMemory, ...]:
    return tuple(DeviceMemory(index=i, name=product, total_mib=46_068, free_mib=free_mib) for i in range(count))


JOBS = [
    # Two shapes of host each, one too small for the model: answers of both kinds.
    PlanJob(llama(8, 512, 2_000), AutoPolicy(), (gpus(1, 46_068), gpus(2, 20_000), gpus(1, 1_500))),
    PlanJob(
        llama(6, 768, 3_000),
        CustomPolicy(context_per_slot=4096, slots=2, cache_type="f16", fit_target_mib=1024),
        (gpus(1, 46_068), gpus(4, 46_068, "NVIDIA A100")),
    ),
    PlanJob(
        llama(4, 256, 500),
        CustomPolicy(context_per_slot=2048, slots=4, cache_type="q8_0", fit_target_mib=1024),
        (gpus(1, 10_000),),
    ),
    PlanJob(llama(4, 256, 500, architecture="unmodelled-arch"), AutoPolicy(), (gpus(1, 46_068),)),
]


def dies_in_a_worker(job: PlanJob) -> tuple[_parallel.PlanAnswer, ...]:
    """`plan_job`, but a worker process running it dies at once (as one the kernel's OOM killer ends)."""
    if multiprocessing.parent_process() is not None:
        os._exit(3)
    return plan_job(job)


def where(job: PlanJob) -> tuple[_parallel.PlanAnswer, ...]:
    """Which process planned the job (its pid, as the answer to each device set)."""
    return tuple(str(os.getpid()) for _ in job.devices)


def raises_everywhere(job: PlanJob) -> tuple[_parallel.PlanAnswer, ...]:
    raise ValueError("a bug in the estimator")


def test_plans_made_by_worker_processes_are_the_plans_made_here() -> None:
    here = [plan_job(job) for job in JOBS]
    assert any(isinstance(a, Plan) for a in here[0]) and any(isinstance(a, str) for a in here[0])
    assert all(isinstance(a, str) and "not modelled" in a for a in here[3])
    pooled = plan_all(JOBS, workers=3, min_parallel_layers=0)
    assert pooled == here
    many = JOBS * 4  # more jobs than the workers hold at once, so this process plans some too
    planners = {answer for answers in plan_all(many, workers=3, min_parallel_layers=0, run=where) for answer in answers}
    assert len(planners) > 1 and str(os.getpid()) in planners  # workers and this process, each a share


def test_a_worker_that_dies_leaves_its_jobs_to_this_process(caplog: pytest.LogCaptureFixture) -> None:
    here = [plan_job(job) for job in JOBS]
    with caplog.at_level(logging.WARNING, logger="qiip.planner"):
        pooled = plan_all(JOBS, workers=2, min_parallel_layers=0, run=dies_in_a_worker)
    assert pooled == here
    assert any("planner worker processes failed" in r.getMessage() for r in caplog.records)


class NoPool:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no worker process should be started")


class PoolThatCannotStart:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __enter__(self) -> PoolThatCannotStart:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, *args: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    def shutdown(self, **kwargs: object) -> None:
        return None


def test_one_core_or_little_work_plans_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_parallel, "ProcessPoolExecutor", NoPool)
    here = [plan_job(job) for job in JOBS]
    assert plan_all(JOBS, workers=1, min_parallel_layers=0) == here
    assert plan_all(JOBS, workers=4) == here  # far below MIN_PARALLEL_LAYERS
    assert plan_all(JOBS[:1], workers=4, min_parallel_layers=0) == [here[0]]  # one job: nothing to share out
    assert plan_all([], workers=4) == []


def test_a_pool_that_cannot_start_plans_here(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(_parallel, "ProcessPoolExecutor", PoolThatCannotStart)
    here = [plan_job(job) for job in JOBS]
    with caplog.at_level(logging.WARNING, logger="qiip.planner"):
        assert plan_all(JOBS, workers=2, min_parallel_layers=0) == here
    assert any("Resource temporarily unavailable" in r.getMessage() for r in caplog.records)


def test_a_bug_in_a_job_is_raised_not_planned_around() -> None:
    with pytest.raises(ValueError, match="a bug in the estimator"):
        plan_all(JOBS, workers=2, min_parallel_layers=0, run=raises_everywhere)


def test_a_worker_imports_the_planner_without_the_verifier_clients() -> None:
    # What a spawned worker imports to run a job: cheap enough that a pool pays for itself within a second.
    code = (
        "import sys, qiip_core.planner._parallel; "
        "print(sorted(m for m in ('aiohttp', 'httpx', 'pynvml', 'gguf', 'qiip_core.nodes') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

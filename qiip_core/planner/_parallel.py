"""Plans made over several processes: many independent proofs that a model and a sizing fit a set of devices.

A controller placing a fleet for the first time asks hundreds of them (one per model shape, sizing policy and
host shape); each is a pure function of those inputs and costs 15-300 ms of CPU, mostly the compute graph built
and replayed through ggml's allocator (`_estimate._compute_buffers`). They share nothing but that replay, which
a job keeps to itself, so they spread over processes with nothing to share back:

```
plan_all(jobs) -> [(Plan | refusal, ...) per job]       answers in the jobs' order, one per device set
  a job                one shape and policy on several device sets: its device sets share graphs and replays
  pool                 ProcessPoolExecutor, one spawned worker per usable core but one, started for this call
                       and shut down before it returns: the workers take the costliest jobs first, this thread
                       the cheapest, until they meet (it plans while the workers start, so no core waits)
  serial, here         one usable core, too little work for a worker's start (`min_parallel_layers`), or a
                       pool that cannot start
  a worker that dies   its jobs, and every job it took down with it, are planned here, serially
```

Workers are spawned, never forked: the daemon calls this from a thread while its event loop runs, and a fork
copies another thread's locks mid-use. A spawned worker imports this module and what planning needs (not the
verifier's clients: the planner's `__init__` is lazy), and the program's main module, as multiprocessing's spawn
does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from qiip_core._errors import PlanError
from qiip_core.planner._choose import choose_estimator
from qiip_core.planner._plan import Plan, plan
from qiip_core.planner._policy import AutoPolicy, CustomPolicy
from qiip_core.planner._shape import ModelShape
from qiip_core.planner._types import DeviceMemory

__all__ = ["MIN_PARALLEL_LAYERS", "PlanAnswer", "PlanJob", "plan_all", "plan_job", "usable_cores"]

logger = logging.getLogger("qiip.planner")

MIN_PARALLEL_LAYERS = 4_000
"""Layers planned (a job's `layers`, summed) below which `plan_all` plans in this process: a layer planned on one
device set costs about 0.25 ms of CPU, a worker's start (a new interpreter importing the planner) about 0.5 s, so
a pool pays for itself from about a second of proofs (on 2 cores: 100 hosts of `bench/placement.py` ask 3,500
layers, 250 hosts 6,700)."""

PlanAnswer = Plan | str
"""The plan, or why there is none (the planner's `PlanError` message)."""

PlanRun = Callable[["PlanJob"], tuple[PlanAnswer, ...]]
"""What plans one job (`plan_job`; a worker runs it, so it must be a module-level function)."""


@dataclass(frozen=True)
class PlanJob:
    """One model and sizing policy, planned on each of several device sets (one host shape each)."""

    shape: ModelShape
    """The model."""
    policy: AutoPolicy | CustomPolicy
    """The sizing policy."""
    devices: tuple[tuple[DeviceMemory, ...], ...]
    """The device sets, each the NVIDIA GPUs of one host (in NVML order) or its one CPU device."""

    @property
    def layers(self) -> int:
        """What the job costs, roughly: the model's blocks times the device sets."""
        return max(1, self.shape.n_layers) * len(self.devices)


def plan_job(job: PlanJob) -> tuple[PlanAnswer, ...]:
    """Plan `job` on each of its device sets, in this process, with the estimator `choose_estimator` picks.

    Args:
        job: the model, the policy and the device sets.

    Returns:
        One answer per device set, in order: the plan, or the `PlanError` message that refused it (an
        architecture the Python estimator does not model is refused on every set).

    Raises:
        ValueError: the estimator refused its inputs (as `plan` raises it: a bug, never a refusal).
    """
    try:
        estimator = choose_estimator(job.shape)
    except PlanError as exc:
        return tuple(exc.message for _ in job.devices)
    answers: list[PlanAnswer] = []
    for devices in job.devices:
        try:
            answers.append(plan(job.shape, devices, job.policy, estimator=estimator))
        except PlanError as exc:
            answers.append(exc.message)
    return tuple(answers)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says; else `os.cpu_count()`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def plan_all(
    jobs: Sequence[PlanJob],
    *,
    workers: int | None = None,
    min_parallel_layers: int = MIN_PARALLEL_LAYERS,
    run: PlanRun = plan_job,
) -> list[tuple[PlanAnswer, ...]]:
    """Plan every job, over a pool of worker processes where that is faster (see the module's map).

    The answers are what `run` gives in this process, whatever runs them: a worker runs the same function on the
    same inputs, and nothing it reads is shared with another job.

    Args:
        jobs: the jobs.
        workers: processes that plan, this one included (None: `usable_cores()`); 1 plans every job here.
        min_parallel_layers: below this much work (`PlanJob.layers`, summed) every job is planned here.
        run: what plans one job (tests give their own, defined at a module's top level so a worker can import it).

    Returns:
        Each job's answers, in the order of `jobs`.

    Raises:
        ValueError: as `plan_job`, from whichever process planned the job.
    """
    count = min(workers if workers is not None else usable_cores(), len(jobs)) - 1  # worker processes
    answers: list[tuple[PlanAnswer, ...] | None] = [None] * len(jobs)
    if count > 0 and sum(job.layers for job in jobs) >= min_parallel_layers and _may_start_processes():
        _plan_in_pool(jobs, answers, count, run)
    return [found if found is not None else run(job) for job, found in zip(jobs, answers, strict=True)]


def _may_start_processes() -> bool:
    # A daemonic process (multiprocessing's) may not start children.
    return not multiprocessing.current_process().daemon


def _plan_in_pool(
    jobs: Sequence[PlanJob], answers: list[tuple[PlanAnswer, ...] | None], count: int, run: PlanRun
) -> None:
    """Fill `answers` with `count` workers and this thread; a job left None is planned by the caller, here."""
    # The costliest first to the workers, the cheapest to this thread: the last jobs left are short ones, so no
    # process idles long while another finishes, and this thread looks for finished jobs often.
    left = deque(sorted(range(len(jobs)), key=lambda i: -jobs[i].layers))
    try:
        with ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context("spawn")) as pool:
            running: dict[Future[tuple[PlanAnswer, ...]], int] = {}
            try:
                while left or running:
                    while left and len(running) < 2 * count:  # one job running and one waiting per worker
                        position = left.popleft()
                        running[pool.submit(run, jobs[position])] = position
                    if left:
                        position = left.pop()
                        answers[position] = run(jobs[position])
                    else:
                        wait(running, return_when=FIRST_COMPLETED)
                    for future in [f for f in running if f.done()]:
                        answers[running.pop(future)] = future.result()
            except BrokenProcessPool:
                # Keep what finished before the worker died; the rest is planned here.
                for future, position in running.items():
                    if future.done() and not future.cancelled() and future.exception() is None:
                        answers[position] = future.result()
                raise
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    except (BrokenProcessPool, OSError, RuntimeError) as exc:
        # A worker that died (killed, out of memory), or a pool that could not start: never a wrong answer, so
        # what is left is planned here, serially, as with one core.
        unplanned = sum(1 for found in answers if found is None)
        logger.warning(
            "planner worker processes failed (%s); %d proof job(s) are planned in this process", exc, unplanned
        )

"""The planner's proof that a template fits a host's devices, made once per proof input and shared.

A placement asks whether every deployment's template fits every kind of host of the pool: at 1,000 hosts and 200
deployments that is a thousand questions a pass, and each answer the planner proves from scratch costs tens of
milliseconds (`plan`: the compute graph rebuilt and replayed through ggml's allocator). The answers are shared by
what they are computed from, never by who asked:

```
proof key                                    what it holds
  llama.cpp   (shape, policy, devices)       the model's shape (the GGUF's metadata, compared whole: two
                                             templates of one base model's fine-tunes share it), the sizing
                                             policy the runtime becomes, every field of every device (index,
                                             product, total and free MiB, kind, CPU repacks)
  vLLM        (weights bytes, total MiB)     the size the model cache reports now, read at every question
```

A key holds every input the proof reads, so a shared proof is the proof itself: hosts of one shape share one,
hosts differing in any field of a device do not, and a changed input is a new key (no entry is ever updated in
place). A model that cannot be read is not remembered for long (`retry_after_s`): once the model cache has it, the
next pass proves the fit.

A question is proven when it is asked (`fit(template, devices)`), or with others before they are asked
(`prove_all`, which the controller calls with every question a pass would ask): then the planner's proofs of one
model shape and policy are one job, and the jobs spread over worker processes (`planner._parallel.plan_all`).
Either way a proof is the same function of the same inputs (`plan_job`), so where it ran changes nothing.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from qiip_core._errors import QiipError
from qiip_core.deployments._placement import Fit
from qiip_core.deployments._resource import Template
from qiip_core.nodes import Engine
from qiip_core.planner import AutoPolicy, CustomPolicy, DeviceMemory, ModelShape, Plan, is_modelled
from qiip_core.planner._parallel import MIN_PARALLEL_LAYERS, PlanJob, plan_all, plan_job

__all__ = ["PlannerFit"]

ShapeOf = Callable[[Template], ModelShape]
"""Reads a template's model shape (the GGUF's metadata from the shared model cache); raises `QiipError`."""


@dataclass(frozen=True)
class _Read:
    """What a template's proofs are computed from, read once per template hash."""

    shape: ModelShape | str
    """The model's shape, or why it cannot be read."""
    shape_id: int
    """The shape's number: equal shapes share one; a failed read gets a number of its own."""
    policy: AutoPolicy | CustomPolicy
    """The sizing policy the runtime becomes (`Runtime.policy`)."""
    policy_key: str
    """The policy as JSON, the part of the proof key it gives."""
    read_at: float
    """`time.monotonic()` when it was read."""


class PlannerFit:
    """The planner's proof that a template fits a host's devices, shared by proof input (see the module's map).

    A `FitCheck`: `fit(template, devices) -> Fit`.

    Args:
        shape_of: reads a template's model (the GGUF's metadata from the shared model cache).
        size_of: a vLLM template's weights in bytes, when known (None: the fit cannot be proven).
        cache_size: proofs kept (least recently used go first).
        retry_after_s: seconds a model that could not be read is refused before it is read again.
        clock: `time.monotonic` (tests give their own).
        workers: processes `prove_all` plans in, this one included (None: one per usable core; 1: this one).
        min_parallel_layers: less work than this (`PlanJob.layers`, summed) is planned here (`plan_all`).
    """

    def __init__(
        self,
        shape_of: ShapeOf,
        *,
        size_of: Callable[[Template], int | None] | None = None,
        cache_size: int = 4096,
        retry_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        workers: int | None = None,
        min_parallel_layers: int = MIN_PARALLEL_LAYERS,
    ) -> None:
        self.shape_of = shape_of
        self.size_of = size_of or (lambda _t: None)
        self.cache_size = cache_size
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.workers = workers
        self.min_parallel_layers = min_parallel_layers
        self._proofs: OrderedDict[Hashable, Fit] = OrderedDict()
        self._reads: OrderedDict[str, _Read] = OrderedDict()
        self._shape_ids: OrderedDict[ModelShape, int] = OrderedDict()
        # Numbers are never reused: a shape forgotten and read again gets a new one (a miss, never a wrong hit).
        self._numbers = itertools.count()
        self.proved = 0
        """Proofs made by the planner (not served from the cache), since construction."""

    def __call__(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit:
        """Whether `template` fits `devices`, proven once per proof key.

        Args:
            template: the template (its engine, model and runtime).
            devices: the devices a replica would run on (`host_devices`).

        Returns:
            The fit; never raises (what cannot be proven is a `Fit` that does not fit, saying why).
        """
        key = self.key(template, devices)
        found = self._proofs.get(key)
        if found is not None:
            self._proofs.move_to_end(key)
            return found
        found = self._answer_early(template, devices)
        if found is None:
            read = self._read(template)
            assert isinstance(read.shape, ModelShape)  # an unread shape is answered early
            found = _fit_of(plan_job(PlanJob(read.shape, read.policy, (devices,)))[0], devices)
        return self._keep(key, found)

    def proven(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit | None:
        """The proof that `template` fits `devices` if it is made already, else None (nothing is proven here).

        Args:
            template: the template.
            devices: the devices.

        Returns:
            The fit as `fit(template, devices)` would answer it now, or None when that would prove it.
        """
        key = self.key(template, devices)
        found = self._proofs.get(key)
        if found is not None:
            self._proofs.move_to_end(key)
        return found

    def prove_all(self, questions: Iterable[tuple[Template, tuple[DeviceMemory, ...]]]) -> int:
        """Prove every question not proven yet, the planner's proofs over worker processes where that is faster.

        The answers are those `fit(template, devices)` would give one by one: each is the same proof, wherever it
        runs (`plan_all`: a worker that dies leaves its proofs to this process).

        Args:
            questions: (template, devices) pairs; repeated and proven ones cost a key each.

        Returns:
            The proofs made.

        Raises:
            ValueError: the planner refused its inputs (a bug, as `fit` would raise it).
        """
        wanted: dict[Hashable, tuple[Template, tuple[DeviceMemory, ...]]] = {}
        for template, devices in questions:
            key = self.key(template, devices)
            if key not in self._proofs:
                wanted.setdefault(key, (template, devices))
        jobs: dict[tuple[int, str], list[tuple[Hashable, tuple[DeviceMemory, ...]]]] = {}
        models: dict[tuple[int, str], tuple[ModelShape, AutoPolicy | CustomPolicy]] = {}
        for key, (template, devices) in wanted.items():
            early = self._answer_early(template, devices)
            if early is not None:
                self._keep(key, early)
                continue
            # One job per model shape and policy: its host shapes share the graphs the planner builds and replays.
            read = self._read(template)
            assert isinstance(read.shape, ModelShape)  # an unread shape is answered early
            jobs.setdefault((read.shape_id, read.policy_key), []).append((key, devices))
            models[read.shape_id, read.policy_key] = (read.shape, read.policy)
        planned = [PlanJob(*models[job], tuple(devices for _, devices in asked)) for job, asked in jobs.items()]
        answers = plan_all(planned, workers=self.workers, min_parallel_layers=self.min_parallel_layers)
        for asked, answered in zip(jobs.values(), answers, strict=True):
            for (key, devices), answer in zip(asked, answered, strict=True):
                self._keep(key, _fit_of(answer, devices))
        return len(wanted)

    def _keep(self, key: Hashable, found: Fit) -> Fit:
        self.proved += 1
        self._proofs[key] = found
        while len(self._proofs) > self.cache_size:
            self._proofs.popitem(last=False)
        return found

    def key(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Hashable:
        """The proof key of `template` on `devices`: every input the proof reads (see the module's map).

        Args:
            template: the template.
            devices: the devices.

        Returns:
            A hashable key; two questions with equal keys have the same answer.
        """
        if template.engine is Engine.VLLM:
            return ("vllm", self.size_of(template), sum(d.total_mib for d in devices))
        read = self._read(template)
        return ("llama_cpp", read.shape_id, read.policy_key, devices)

    def _read(self, template: Template) -> _Read:
        found = self._reads.get(template.hash)
        now = self.clock()
        if found is not None and (not isinstance(found.shape, str) or now - found.read_at < self.retry_after_s):
            self._reads.move_to_end(template.hash)
            return found
        shape: ModelShape | str
        try:
            shape = self.shape_of(template)
        except QiipError as exc:
            shape = f"its model cannot be read: {exc.message}"
        if isinstance(shape, str):
            number = next(self._numbers)
        else:
            number = self._shape_ids.setdefault(shape, next(self._numbers))
            self._shape_ids.move_to_end(shape)
            while len(self._shape_ids) > 64:
                self._shape_ids.popitem(last=False)
        policy = template.runtime.policy()
        found = _Read(shape, number, policy, policy.model_dump_json(), now)
        self._reads[template.hash] = found
        while len(self._reads) > self.cache_size:
            self._reads.popitem(last=False)
        return found

    def _answer_early(self, template: Template, devices: tuple[DeviceMemory, ...]) -> Fit | None:
        """The answer that needs no plan (vLLM's, an unreadable model, weights alone too large, an architecture
        the Python estimator does not model), or None: the planner must prove it."""
        total = float(sum(d.total_mib for d in devices))
        if template.engine is Engine.VLLM:
            size = self.size_of(template)
            if size is None:
                return Fit(
                    False, "the model's size is unknown (it is not in the shared cache), so no fit can be proven"
                )
            # vLLM takes gpu_memory_utilization (0.9) of each GPU; the weights must leave room for a K/V cache.
            need = size / 2**20 * 1.1
            usable = total * 0.9
            if need > usable:
                return Fit(False, f"its weights need about {need:,.0f} MiB; 90% of the GPUs is {usable:,.0f} MiB")
            return Fit(True, f"weights {need:,.0f} MiB of {usable:,.0f} MiB usable", used_mib=need, total_mib=total)
        shape = self._read(template).shape
        if isinstance(shape, str):
            return Fit(False, shape)
        weights_mib = shape.weights_bytes / 2**20
        free = sum(d.free_mib for d in devices)
        if weights_mib > free:  # no estimate needed: the weights alone do not fit
            return Fit(False, f"its weights alone ({weights_mib:,.0f} MiB) exceed the {free:,} MiB free")
        if not is_modelled(shape):
            return Fit(
                False, f"the planner does not model architecture {shape.architecture!r}, so no fit can be proven"
            )
        return None


def _fit_of(answer: Plan | str, devices: tuple[DeviceMemory, ...]) -> Fit:
    """The fit a plan (or the planner's refusal) proves on `devices`."""
    if isinstance(answer, str):
        return Fit(False, answer)
    used = sum(d.total_mib for d in answer.estimate.devices)
    what = f"{answer.slots} slot(s) × {answer.context_per_slot:,} tokens, {answer.cache_type_k} K/V"
    return Fit(
        True,
        what,
        used_mib=used,
        total_mib=float(sum(d.total_mib for d in devices)),
        slots=answer.slots,
        context_per_slot=answer.context_per_slot,
    )

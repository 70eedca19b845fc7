"""Turn a sizing policy into a plan: context per slot, slots and K/V cache type, and why they fit.

Automatic policy (the seed's planner):

1. F16 K/V with `--flash-attn auto` first.
2. The context every slot is guaranteed: the training context at one slot if it fits, else the largest
   multiple of 256 tokens that fits, found by binary search down to the floor `min(4096, training context)`.
3. With that context fixed, the most slots up to 256: doubling while they fit, then binary search between
   the last that fit and the first that did not.
4. Only if F16 cannot fit one slot at the floor: the same search with Q8_0 K and V and `--flash-attn on`.
   Never below Q8_0; if Q8_0 does not fit either, planning fails with a `PlanError`.

All slots share one unified K/V pool (`--kv-unified`) of `aggregate = ceil256(context × slots)` cells, so
each slot may use up to `min(training context, aggregate)` tokens when the others are idle. A candidate fits
when on every device `model + context + compute + fit_target_mib + 4 ≤ free` (MiB).

Custom policy: the rules of `validate_policy`, then one estimate, which must fit unless the policy allows an
estimator overrun (the plan then records `estimator_overrun_used`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qiip_core._errors import PlanError
from qiip_core._violation import FieldNames, offers, spell, spell_setting
from qiip_core.planner._estimate import Estimator, MemoryEstimate
from qiip_core.planner._memory import Cache
from qiip_core.planner._policy import AutoPolicy, CustomPolicy, parse_policy, validate_policy
from qiip_core.planner._shape import ModelShape
from qiip_core.planner._types import (
    CONTEXT_FLOOR,
    CONTEXT_STEP,
    FIT_SLACK_MIB,
    MAX_AGGREGATE_CONTEXT,
    MAX_SLOTS,
    CacheType,
    DeviceMemory,
    ceil_step,
)

__all__ = ["Fits", "Plan", "auto_search", "fits", "plan"]

logger = logging.getLogger("qiip.planner")

_FLASH_ATTN: dict[CacheType, Literal["auto", "on"]] = {"f16": "auto", "q8_0": "on"}
"""Flash attention per cache type: `auto` with F16; a quantised V cache needs it `on`."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A planned llama-server sizing: the seed's `llamacpp_runtime.effective` fields, and why they fit."""

    policy: AutoPolicy | CustomPolicy
    """The policy planned for (the record's `requested`)."""
    train_context: int
    """The model's training context in tokens."""
    context_per_slot: int
    """Tokens every slot is guaranteed when all slots are busy."""
    slot_context_limit: int
    """Tokens one slot may use when the others are idle: `min(train_context, aggregate_context)`; llama-server's
    `n_ctx_slot`."""
    slots: int
    """Parallel sequences (`--parallel`)."""
    aggregate_context: int
    """K/V cells of the unified pool (`--ctx-size`): `ceil256(context_per_slot × slots)`."""
    cache_type_k: CacheType
    """`--cache-type-k`."""
    cache_type_v: CacheType
    """`--cache-type-v`."""
    flash_attn: Literal["auto", "on"]
    """`--flash-attn`."""
    kv_unified: bool = True
    """`--kv-unified`: always one pool shared by the slots."""
    gpu_layers: int
    """Layers offloaded to GPUs: all of them (`total_layers`) in GPU mode, 0 in CPU mode."""
    total_layers: int
    """Blocks plus the output layer, as llama.cpp counts them (`offloaded L/L layers`)."""
    estimator_overrun_used: bool = False
    """A custom policy was launched although the estimate said it does not fit."""
    estimate: MemoryEstimate
    """The estimate of the chosen sizing, per device."""
    estimator: str
    """Who estimated: `python` or `llama-fit-params`."""
    devices: tuple[DeviceMemory, ...]
    """The devices planned on, with the free memory the plan was made against."""
    architecture: str = "llama"
    """The model's `general.architecture`."""
    memory_known: bool = True
    """Whether llama.cpp's caches for this architecture are modelled; when not, `caches` is empty and the
    verifier records the cache checks as unverified."""
    caches: tuple[Cache, ...] = ()
    """The caches llama-server will allocate (`_memory.memory_layout`); empty for an encoder or when unknown."""
    tried: int = field(default=0, compare=False)
    """How many candidates were estimated."""

    @property
    def cpu_mode(self) -> bool:
        """Whether the plan runs on the host CPU (no NVIDIA GPU)."""
        return self.devices[0].kind == "cpu"

    def requested(self) -> dict[str, Any]:
        """The seed's `llamacpp_runtime.requested`: the policy as JSON."""
        return self.policy.model_dump()

    def effective(self) -> dict[str, Any]:
        """The seed's `llamacpp_runtime.effective`, plus the device mode and what that means for layer offload."""
        return {
            "train_context": self.train_context,
            "context_per_slot": self.context_per_slot,
            "slot_context_limit": self.slot_context_limit,
            "slots": self.slots,
            "aggregate_context": self.aggregate_context,
            "cache_type_k": self.cache_type_k,
            "cache_type_v": self.cache_type_v,
            "flash_attn": self.flash_attn,
            "kv_unified": self.kv_unified,
            "gpu_layers": self.gpu_layers,
            "total_layers": self.total_layers,
            "estimator_overrun_used": self.estimator_overrun_used,
            "device_mode": "cpu" if self.cpu_mode else "gpu",
            "layer_offload": (
                "not applicable: CPU mode runs every layer on the host, no layer is offloaded"
                if self.cpu_mode
                else f"{self.gpu_layers}/{self.total_layers} layers on GPU"
            ),
        }

    def summary(self) -> str:
        """One log line in the seed's format: `qiip_fit_plan: sizing=… train_context=… …`."""
        return (
            f"qiip_fit_plan: sizing={self.policy.sizing} train_context={self.train_context} "
            f"context_per_slot={self.context_per_slot} slots={self.slots} aggregate_context={self.aggregate_context} "
            f"fit_target_mib={self.policy.fit_target_mib} cache_type_k={self.cache_type_k} "
            f"cache_type_v={self.cache_type_v} flash_attn={self.flash_attn} "
            f"estimator_overrun_used={str(self.estimator_overrun_used).lower()}"
        )


def fits(estimate: MemoryEstimate, devices: Sequence[DeviceMemory], fit_target_mib: int) -> bool:
    """The seed's fit rule: on every device `model + context + compute + target + 4 ≤ free` (MiB).

    Args:
        estimate: the candidate's estimate, one entry per device.
        devices: the devices, in the same order.
        fit_target_mib: MiB to keep free on every device.

    Returns:
        True when the candidate fits on every device.
    """
    return all(
        e.total_mib + fit_target_mib + FIT_SLACK_MIB <= d.free_mib
        for e, d in zip(estimate.devices, devices, strict=True)
    )


def _shortfall(estimate: MemoryEstimate, devices: Sequence[DeviceMemory], fit_target_mib: int) -> str:
    parts = []
    for e, d in zip(estimate.devices, devices, strict=True):
        need = e.total_mib + fit_target_mib + FIT_SLACK_MIB
        if need > d.free_mib:
            where = "system memory (CPU mode)" if d.kind == "cpu" else f"GPU {d.index} ({d.name})"
            parts.append(
                f"{where} needs {need:,.0f} MiB (model {e.model_mib:,.0f} + K/V {e.context_mib:,.0f} + compute "
                f"{e.compute_mib:,.0f} + output {e.output_mib:,.0f} + target {fit_target_mib} + {FIT_SLACK_MIB}) "
                f"but has {d.free_mib:,} MiB free"
            )
    return "; ".join(parts)


class _Search:
    """Candidates and their estimates, each estimated once."""

    def __init__(self, shape: ModelShape, devices: Sequence[DeviceMemory], estimator: Estimator, target: int) -> None:
        self.shape, self.devices, self.estimator, self.target = shape, devices, estimator, target
        self.cache: dict[tuple[int, int, CacheType], MemoryEstimate] = {}

    def estimate(self, context: int, slots: int, cache_type: CacheType) -> MemoryEstimate:
        key = (ceil_step(context * slots), slots, cache_type)
        if key not in self.cache:
            self.cache[key] = self.estimator.estimate(
                self.shape,
                aggregate_context=key[0],
                slots=slots,
                cache_type=cache_type,
                flash_attn=_FLASH_ATTN[cache_type],
                devices=self.devices,
            )
        return self.cache[key]

    def fits(self, context: int, slots: int, cache_type: CacheType) -> bool:
        if ceil_step(context * slots) > MAX_AGGREGATE_CONTEXT:
            return False
        return fits(self.estimate(context, slots, cache_type), self.devices, self.target)


def _largest(low: int, high: int, ok: Callable[[int], bool]) -> int:
    """The largest `x` in `[low, high)` with `ok(x)`, given `ok(low)` and that `ok` is monotone."""
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


Fits = Callable[[int, int, CacheType], bool]
"""Whether a candidate fits: `(context per slot, slots, cache type) -> bool`."""


def auto_search(train: int, fits: Fits, cache_type: CacheType) -> tuple[int, int] | None:
    """The automatic search for one cache type (steps 2 and 3 of the module docstring).

    Args:
        train: the model's training context in tokens.
        fits: the fit rule for a candidate.
        cache_type: the K/V cache type to search with.

    Returns:
        (context per slot, slots), or None when one slot at the floor `min(4096, train)` does not fit.
    """
    floor = min(CONTEXT_FLOOR, train)
    if fits(train, 1, cache_type):
        context = train
    elif floor == train or not fits(floor, 1, cache_type):
        return None
    else:
        # Multiples of 256 between the floor and the training context, in steps of 256.
        steps = _largest(
            floor // CONTEXT_STEP,
            -(-train // CONTEXT_STEP),
            lambda k: fits(k * CONTEXT_STEP, 1, cache_type),
        )
        context = steps * CONTEXT_STEP
    slots = 1
    while slots * 2 <= MAX_SLOTS and fits(context, slots * 2, cache_type):
        slots *= 2
    if slots < MAX_SLOTS:
        slots = _largest(slots, min(slots * 2, MAX_SLOTS + 1), lambda s: fits(context, s, cache_type))
    return context, slots


def _custom_advice(names: FieldNames | None) -> str:
    """What to change when a custom sizing does not fit, in the caller's names for the fields."""
    advice = (
        f"Lower {spell(names, 'context_per_slot')} or {spell(names, 'slots')}, "
        f"use {spell_setting(names, 'cache_type', 'q8_0')}, lower {spell(names, 'fit_target_mib')}"
    )
    if offers(names, "allow_estimator_overrun"):
        advice += f", or set {spell(names, 'allow_estimator_overrun')} if you know the estimate is pessimistic"
    return advice + "."


def plan(
    shape: ModelShape,
    devices: Sequence[DeviceMemory],
    policy: AutoPolicy | CustomPolicy | Mapping[str, Any],
    *,
    estimator: Estimator,
    names: FieldNames | None = None,
) -> Plan:
    """Plan a llama-server sizing for `shape` on `devices`.

    Args:
        shape: the model.
        devices: the NVIDIA GPUs (in NVML order), or the one CPU device of CPU mode.
        policy: the sizing policy, as a model or a decoded JSON object.
        estimator: who estimates each candidate (`FitParamsEstimator` when installed, else `PythonEstimator`).
        names: how the caller spells the policy's fields in the messages (`{"context_per_slot": "--ctx-size"}`
            for the CLI); advice to set a field it does not name is left out. None: the policy's keys, all advice.

    Returns:
        The plan.

    Raises:
        PlanError: the policy is invalid (`.violations` lists every broken rule), nothing fits even at the
            floor with Q8_0 (automatic), the custom sizing does not fit and overrun is not allowed, or there
            are no devices.
    """
    if not devices:
        raise PlanError("There is no device to plan on; read the devices first (read_devices).")
    parsed = parse_policy(policy)
    violations = validate_policy(parsed, train_context=shape.n_ctx_train, devices=devices, shape=shape, names=names)
    if violations:
        raise PlanError(
            "The sizing policy is invalid: " + " ".join(v.message for v in violations), violations=violations
        )
    search = _Search(shape, devices, estimator, parsed.fit_target_mib)
    overrun = False
    if isinstance(parsed, CustomPolicy):
        context, slots, cache_type = parsed.context_per_slot, parsed.slots, parsed.cache_type
        if not search.fits(context, slots, cache_type):
            why = _shortfall(search.estimate(context, slots, cache_type), devices, parsed.fit_target_mib)
            if not parsed.allow_estimator_overrun:
                raise PlanError(
                    f"The custom sizing ({slots} slots of {context} tokens, {cache_type} K/V) does not fit: {why}. "
                    + _custom_advice(names)
                )
            logger.warning("custom sizing launched over the estimate (allow_estimator_overrun): %s", why)
            overrun = True
    else:
        found: tuple[int, int, CacheType] | None = None
        for candidate in ("f16", "q8_0"):
            cache: CacheType = "f16" if candidate == "f16" else "q8_0"
            if not shape.supports_cache_type(cache):
                continue
            result = auto_search(shape.n_ctx_train, search.fits, cache)
            if result is not None:
                found = (*result, cache)
                break
        if found is None:
            floor = min(CONTEXT_FLOOR, shape.n_ctx_train)
            last: CacheType = "q8_0" if shape.supports_cache_type("q8_0") else "f16"
            why = _shortfall(search.estimate(floor, 1, last), devices, parsed.fit_target_mib)
            raise PlanError(
                f"The model does not fit even with one slot of {floor} tokens and a {last} K/V cache: {why}. "
                "Use devices with more free memory, a smaller (more quantised) model, or a lower "
                f"{spell(names, 'fit_target_mib')}."
            )
        context, slots, cache_type = found
    aggregate = ceil_step(context * slots)
    cpu = devices[0].kind == "cpu"
    chosen = search.estimate(context, slots, cache_type)
    result_plan = Plan(
        policy=parsed,
        train_context=shape.n_ctx_train,
        context_per_slot=context,
        slot_context_limit=min(shape.n_ctx_train, aggregate),
        slots=slots,
        aggregate_context=aggregate,
        cache_type_k=cache_type,
        cache_type_v=cache_type,
        flash_attn=_FLASH_ATTN[cache_type],
        gpu_layers=0 if cpu else shape.total_layers,
        total_layers=shape.total_layers,
        estimator_overrun_used=overrun,
        estimate=chosen,
        estimator=estimator.name,
        devices=tuple(devices),
        architecture=shape.architecture,
        memory_known=shape.memory_known,
        caches=chosen.caches,
        tried=len(search.cache),
    )
    logger.info("%s (%d candidates, estimator %s)", result_plan.summary(), result_plan.tried, estimator.name)
    return result_plan

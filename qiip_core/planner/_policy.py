"""Sizing policies (the `requested` part of `llamacpp_runtime`) and the one rule set that checks them.

```
SizingPolicy = AutoPolicy | CustomPolicy      discriminated by `sizing`
AutoPolicy(fit_target_mib=512)                the planner chooses context, slots and cache type
CustomPolicy(fit_target_mib, context_per_slot, slots, cache_type, allow_estimator_overrun=False)
validate_policy(policy or JSON body, *, train_context, devices, names=None) -> [Violation(field, message)]
```

The models check types only (strict: no coercion, no unknown fields), so that any value an operator types can
be turned into precise sentences by `validate_policy`, the rules the daemon (a relaunch request) and the console
(a form) both call. A body that is not even well-typed is reported through the same `Violation`s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from qiip_core._errors import PlanError
from qiip_core._violation import FieldNames, Violation, spell
from qiip_core.planner._shape import ModelShape
from qiip_core.planner._types import (
    CONTEXT_STEP,
    MAX_AGGREGATE_CONTEXT,
    MAX_SLOTS,
    CacheType,
    DeviceMemory,
    ceil_step,
)

__all__ = [
    "AutoPolicy",
    "CustomPolicy",
    "SizingPolicy",
    "Violation",
    "parse_policy",
    "validate_custom",
    "validate_policy",
]

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class AutoPolicy(BaseModel):
    """Let the planner choose: the longest guaranteed context per slot, then the most slots, F16 before Q8_0."""

    model_config = _STRICT

    sizing: Literal["auto"] = "auto"
    """The policy kind."""
    fit_target_mib: int = 512
    """MiB to leave free on every device after the server has loaded."""


class CustomPolicy(BaseModel):
    """An operator's exact sizing; the planner only checks that it fits."""

    model_config = _STRICT

    sizing: Literal["custom"] = "custom"
    """The policy kind."""
    fit_target_mib: int
    """MiB to leave free on every device after the server has loaded."""
    context_per_slot: int
    """Tokens every slot is guaranteed at once; a multiple of 256, at most the training context."""
    slots: int
    """Parallel sequences (`--parallel`), 1 to 256."""
    cache_type: CacheType
    """K and V cache type: `f16`, or `q8_0` (half the memory; flash attention on)."""
    allow_estimator_overrun: bool = False
    """Launch even when the estimate says it does not fit (the record then says `estimator_overrun_used`)."""


SizingPolicy = Annotated[AutoPolicy | CustomPolicy, Field(discriminator="sizing")]
"""A sizing policy, told apart by its `sizing` field."""

_ADAPTER: TypeAdapter[AutoPolicy | CustomPolicy] = TypeAdapter(SizingPolicy)

_FIELD_HINTS = {
    "sizing": "'auto' or 'custom'",
    "fit_target_mib": "a whole number of MiB",
    "context_per_slot": "a whole number of tokens",
    "slots": "a whole number of slots",
    "cache_type": "'f16' or 'q8_0' (the planner never goes below Q8_0)",
    "allow_estimator_overrun": "true or false",
}


def _type_violations(error: ValidationError) -> list[Violation]:
    fields = sorted({*AutoPolicy.model_fields, *CustomPolicy.model_fields})
    violations = []
    for item in error.errors():
        # Discriminated unions prefix the location with the chosen kind ("custom", "slots").
        loc = [str(part) for part in item["loc"] if part not in ("auto", "custom")]
        name = loc[-1] if loc else "sizing"
        kind = item["type"]
        if kind == "extra_forbidden":
            message = f"{name} is not a sizing policy field; the fields are {', '.join(fields)}."
        elif kind == "missing":
            message = f"{name} is required; it must be {_FIELD_HINTS.get(name, 'given')}."
        elif not loc or name == "sizing":
            name = "sizing"
            message = "sizing must be 'auto' or 'custom', in a JSON object of policy fields."
        else:
            message = f"{name} must be {_FIELD_HINTS.get(name, 'valid')}, got {item.get('input')!r}."
        violations.append(Violation(name, message))
    return violations


def parse_policy(data: AutoPolicy | CustomPolicy | Mapping[str, Any] | str | bytes) -> AutoPolicy | CustomPolicy:
    """Read a policy from a model, a decoded JSON object or JSON text.

    Args:
        data: the policy.

    Returns:
        The policy model.

    Raises:
        PlanError: the data is not a well-typed policy; `.violations` says what is wrong, field by field.
    """
    if isinstance(data, AutoPolicy | CustomPolicy):
        return data
    try:
        if isinstance(data, str | bytes):
            return _ADAPTER.validate_json(data)
        return _ADAPTER.validate_python(dict(data))
    except ValidationError as exc:
        violations = _type_violations(exc)
        raise PlanError(_summary(violations), violations=violations) from None
    except (TypeError, ValueError):
        violation = Violation("sizing", "sizing must be 'auto' or 'custom', in a JSON object of policy fields.")
        raise PlanError(_summary([violation]), violations=[violation]) from None


def _summary(violations: Sequence[Violation]) -> str:
    return "The sizing policy is invalid: " + " ".join(v.message for v in violations)


def _target_violations(
    fit_target_mib: int, devices: Sequence[DeviceMemory], names: FieldNames | None
) -> list[Violation]:
    target = spell(names, "fit_target_mib")
    if fit_target_mib < 0:
        return [Violation("fit_target_mib", f"{target} must be at least 0 MiB, got {fit_target_mib}.")]
    for device in devices:
        if fit_target_mib >= device.total_mib:
            where = "CPU mode's system memory" if device.kind == "cpu" else f"GPU {device.index} ({device.name})"
            return [
                Violation(
                    "fit_target_mib",
                    f"{target} ({fit_target_mib} MiB) must be below the total memory of every device; "
                    f"{where} has {device.total_mib} MiB.",
                )
            ]
    return []


def _custom_violations(
    policy: CustomPolicy, train_context: int, shape: ModelShape | None, names: FieldNames | None
) -> list[Violation]:
    found = []
    context_name, slots_name = spell(names, "context_per_slot"), spell(names, "slots")
    ctx = policy.context_per_slot
    if ctx < CONTEXT_STEP or ctx % CONTEXT_STEP:
        # Suggest the aligned values around it that the model can take; past its training context, its largest.
        largest = max(CONTEXT_STEP, train_context // CONTEXT_STEP * CONTEXT_STEP)
        low = max(CONTEXT_STEP, ctx // CONTEXT_STEP * CONTEXT_STEP)
        nearby = [value for value in (low, low + CONTEXT_STEP) if value <= largest] if ctx > CONTEXT_STEP else []
        nearest = str(CONTEXT_STEP) if ctx <= CONTEXT_STEP else " or ".join(map(str, nearby)) or str(largest)
        found.append(
            Violation(
                "context_per_slot",
                f"{context_name} must be a positive multiple of {CONTEXT_STEP} tokens, got {ctx}; try {nearest}.",
            )
        )
    if ctx > train_context:
        found.append(
            Violation(
                "context_per_slot",
                f"{context_name} ({ctx} tokens) exceeds the model's training context of {train_context} tokens.",
            )
        )
    if not 1 <= policy.slots <= MAX_SLOTS:
        found.append(Violation("slots", f"{slots_name} must be between 1 and {MAX_SLOTS}, got {policy.slots}."))
    elif ctx > 0 and ceil_step(ctx * policy.slots) > MAX_AGGREGATE_CONTEXT:
        found.append(
            Violation(
                "slots",
                f"{context_name} × {slots_name} is {ceil_step(ctx * policy.slots):,} tokens, more than llama.cpp's "
                f"largest context of {MAX_AGGREGATE_CONTEXT:,} tokens.",
            )
        )
    if shape is not None and not shape.supports_cache_type(policy.cache_type):
        found.append(
            Violation(
                "cache_type",
                f"{spell(names, 'cache_type')} 'q8_0' needs head widths that are multiples of 32; this model's are "
                f"K {shape.head_dim_k} and V {shape.head_dim_v}, so use 'f16'.",
            )
        )
    return found


def validate_policy(
    policy: AutoPolicy | CustomPolicy | Mapping[str, Any] | str | bytes,
    *,
    train_context: int,
    devices: Sequence[DeviceMemory],
    shape: ModelShape | None = None,
    names: FieldNames | None = None,
) -> list[Violation]:
    """Every rule a sizing policy breaks, for this model and these devices.

    Rules: the fields are well-typed and known; `fit_target_mib` is at least 0 and below every device's
    total; for a custom policy, `context_per_slot` is a positive multiple of 256 and at most the training
    context, `slots` is 1–256, `ceil256(context_per_slot × slots)` is at most 4,294,967,040, and `cache_type`
    is `f16` or `q8_0` (and `q8_0` only with head widths that are multiples of 32, when `shape` is given).

    Args:
        policy: the policy, as a model, a decoded JSON object or JSON text.
        train_context: the model's training context in tokens.
        devices: the devices the server would run on.
        shape: the model, to check that Q8_0 suits its heads.
        names: how the caller spells the fields in the rules' messages (`{"slots": "--slots"}` for the CLI); None
            spells them as the policy's keys. The type errors of an ill-typed policy always name the keys.

    Returns:
        The violations, in field order; empty when the policy is valid.
    """
    try:
        parsed = parse_policy(policy)
    except PlanError as exc:
        typed = list(exc.violations)
        stand_in = _stand_in(policy, typed)
        if stand_in is None:
            return typed
        # The well-typed fields are still checked, so a form shows every field's error at once.
        broken = {v.field for v in typed}
        rules = validate_policy(stand_in, train_context=train_context, devices=devices, shape=shape, names=names)
        return _in_field_order(typed + [v for v in rules if v.field not in broken])
    found = _target_violations(parsed.fit_target_mib, devices, names)
    if isinstance(parsed, CustomPolicy):
        found += _custom_violations(parsed, train_context, shape, names)
    return _in_field_order(found)


def _in_field_order(found: list[Violation]) -> list[Violation]:
    order = list(CustomPolicy.model_fields)
    return sorted(found, key=lambda v: order.index(v.field) if v.field in order else len(order))


_STAND_INS: dict[str, object] = {
    "fit_target_mib": 0,
    "context_per_slot": CONTEXT_STEP,
    "slots": 1,
    "cache_type": "f16",
    "allow_estimator_overrun": False,
}
"""Values that break no rule, put in place of ill-typed fields to check the others."""


def _stand_in(policy: object, typed: list[Violation]) -> CustomPolicy | AutoPolicy | None:
    """The policy with each ill-typed field replaced by a harmless value; None when the kind itself is broken."""
    if isinstance(policy, str | bytes):
        try:
            policy = json.loads(policy)
        except ValueError:
            return None
    if not isinstance(policy, Mapping) or any(v.field == "sizing" for v in typed):
        return None
    # Unknown fields are dropped; each is reported already.
    data = {key: value for key, value in policy.items() if key in _STAND_INS or key == "sizing"}
    data |= {v.field: _STAND_INS[v.field] for v in typed if v.field in _STAND_INS}
    try:
        return parse_policy(data)
    except PlanError:
        return None


_NOT_CUSTOM = "sizing must be 'custom' here; an automatic policy has no sizes to check."


def validate_custom(
    policy: CustomPolicy | Mapping[str, Any] | str | bytes,
    *,
    train_context: int,
    devices: Sequence[DeviceMemory],
    shape: ModelShape | None = None,
    names: FieldNames | None = None,
) -> list[Violation]:
    """Every rule a custom sizing policy breaks; `validate_policy` for policies that must be custom.

    Args:
        policy: the policy, as a model, a decoded JSON object or JSON text.
        train_context: the model's training context in tokens.
        devices: the devices the server would run on.
        shape: the model, to check that Q8_0 suits its heads.
        names: how the caller spells the fields in the messages (`validate_policy`'s `names`).

    Returns:
        The violations; a policy that is automatic breaks the `sizing` rule.
    """
    if isinstance(policy, AutoPolicy):
        return [Violation("sizing", _NOT_CUSTOM)]
    found = validate_policy(policy, train_context=train_context, devices=devices, shape=shape, names=names)
    if not found and isinstance(parse_policy(policy), AutoPolicy):
        found.append(Violation("sizing", _NOT_CUSTOM))
    return found

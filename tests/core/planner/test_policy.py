from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter, ValidationError

from qiip_core import PlanError
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    SizingPolicy,
    Violation,
    parse_policy,
    validate_custom,
    validate_policy,
)

from .conftest import cpu, gpu, shape

DEVICES = [gpu(0, 70000, total_mib=81920), gpu(1, 20000, total_mib=24576)]


def custom(**change: object) -> dict[str, object]:
    return {
        "sizing": "custom",
        "fit_target_mib": 512,
        "context_per_slot": 4096,
        "slots": 4,
        "cache_type": "f16",
    } | change


def messages(violations: list[Violation]) -> list[tuple[str, str]]:
    return [(v.field, v.message) for v in violations]


def test_policies_are_strict_and_discriminated_by_sizing():
    adapter: TypeAdapter[AutoPolicy | CustomPolicy] = TypeAdapter(SizingPolicy)
    assert adapter.validate_json('{"sizing": "auto"}') == AutoPolicy(fit_target_mib=512)
    parsed = adapter.validate_json(json.dumps(custom(allow_estimator_overrun=True)))
    assert isinstance(parsed, CustomPolicy) and parsed.allow_estimator_overrun
    with pytest.raises(ValidationError):
        adapter.validate_python({"sizing": "auto", "fit_target_mib": "512"})  # no coercion
    with pytest.raises(ValidationError):
        adapter.validate_python({"sizing": "auto", "slots": 2})  # no unknown fields
    with pytest.raises(ValidationError):
        AutoPolicy(fit_target_mib=True)
    assert CustomPolicy.model_validate(custom()).model_dump() == custom(allow_estimator_overrun=False)


def test_a_valid_custom_policy_has_no_violations():
    assert validate_custom(custom(), train_context=8192, devices=DEVICES) == []
    assert validate_policy(AutoPolicy(), train_context=8192, devices=DEVICES) == []
    assert validate_custom(json.dumps(custom()), train_context=8192, devices=DEVICES, shape=shape()) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"context_per_slot": 1000},
            [
                (
                    "context_per_slot",
                    "context_per_slot must be a positive multiple of 256 tokens, got 1000; try 768 or 1024.",
                )
            ],
        ),
        (
            # Only values the model can take are suggested: 8192 is its training context.
            {"context_per_slot": 8300},
            [
                ("context_per_slot", "context_per_slot must be a positive multiple of 256 tokens, got 8300; try 8192."),
                (
                    "context_per_slot",
                    "context_per_slot (8300 tokens) exceeds the model's training context of 8192 tokens.",
                ),
            ],
        ),
        (
            {"context_per_slot": 0},
            [("context_per_slot", "context_per_slot must be a positive multiple of 256 tokens, got 0; try 256.")],
        ),
        (
            {"context_per_slot": 16384},
            [
                (
                    "context_per_slot",
                    "context_per_slot (16384 tokens) exceeds the model's training context of 8192 tokens.",
                )
            ],
        ),
        ({"slots": 0}, [("slots", "slots must be between 1 and 256, got 0.")]),
        ({"slots": 257}, [("slots", "slots must be between 1 and 256, got 257.")]),
        (
            {"fit_target_mib": -1},
            [("fit_target_mib", "fit_target_mib must be at least 0 MiB, got -1.")],
        ),
        (
            {"fit_target_mib": 24576},
            [
                (
                    "fit_target_mib",
                    "fit_target_mib (24576 MiB) must be below the total memory of every device; GPU 1 (GPU-1) has "
                    "24576 MiB.",
                )
            ],
        ),
    ],
)
def test_every_value_rule_has_its_sentence(change, expected):
    assert messages(validate_custom(custom(**change), train_context=8192, devices=DEVICES)) == expected


def test_the_aggregate_limit():
    huge = custom(context_per_slot=16_777_216, slots=256)
    found = messages(validate_custom(huge, train_context=16_777_216, devices=DEVICES))
    assert found == [
        (
            "slots",
            "context_per_slot × slots is 4,294,967,296 tokens, more than llama.cpp's largest context of "
            "4,294,967,040 tokens.",
        )
    ]


def test_the_rules_name_each_field_as_the_caller_spells_it():
    flags = {"context_per_slot": "--ctx-size", "slots": "--slots", "cache_type": "--cache-type"}
    huge = custom(context_per_slot=16_777_216, slots=256, cache_type="q8_0", fit_target_mib=-1)
    found = validate_custom(huge, train_context=16_777_216, devices=DEVICES, shape=shape(n_embd=64), names=flags)
    assert [v.field for v in found] == ["fit_target_mib", "slots", "cache_type"]
    # A field the caller does not name keeps its key; the others are composed from the caller's names.
    assert found[0].message == "fit_target_mib must be at least 0 MiB, got -1."
    assert found[1].message.startswith("--ctx-size × --slots is 4,294,967,296 tokens")
    assert found[2].message.startswith("--cache-type 'q8_0' needs head widths")


def test_q8_0_needs_a_model_whose_heads_it_can_store():
    found = validate_custom(custom(cache_type="q8_0"), train_context=8192, devices=DEVICES, shape=shape(n_embd=64))
    assert messages(found) == [
        (
            "cache_type",
            "cache_type 'q8_0' needs head widths that are multiples of 32; this model's are K 16 and V 16, so use "
            "'f16'.",
        )
    ]


def test_cpu_mode_names_system_memory():
    found = validate_policy(AutoPolicy(fit_target_mib=4096), train_context=8192, devices=[cpu(1000, 4096)])
    assert messages(found) == [
        (
            "fit_target_mib",
            "fit_target_mib (4096 MiB) must be below the total memory of every device; CPU mode's system memory "
            "has 4096 MiB.",
        )
    ]


def test_several_violations_come_in_field_order():
    bad = custom(context_per_slot=100_000, slots=0, fit_target_mib=-5)
    assert [v.field for v in validate_custom(bad, train_context=8192, devices=DEVICES)] == [
        "fit_target_mib",
        "context_per_slot",
        "context_per_slot",
        "slots",
    ]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            custom(cache_type="q4_0"),
            [("cache_type", "cache_type must be 'f16' or 'q8_0' (the planner never goes below Q8_0), got 'q4_0'.")],
        ),
        (
            custom(slots="4"),
            [("slots", "slots must be a whole number of slots, got '4'.")],
        ),
        (
            custom(allow_estimator_overrun="yes"),
            [("allow_estimator_overrun", "allow_estimator_overrun must be true or false, got 'yes'.")],
        ),
        (
            {"sizing": "custom", "fit_target_mib": 512, "slots": 4, "cache_type": "f16"},
            [("context_per_slot", "context_per_slot is required; it must be a whole number of tokens.")],
        ),
        (
            custom(gpu_layers=10),
            [
                (
                    "gpu_layers",
                    "gpu_layers is not a sizing policy field; the fields are allow_estimator_overrun, cache_type, "
                    "context_per_slot, fit_target_mib, sizing, slots.",
                )
            ],
        ),
        ({"sizing": "manual"}, [("sizing", "sizing must be 'auto' or 'custom', in a JSON object of policy fields.")]),
        ({}, [("sizing", "sizing must be 'auto' or 'custom', in a JSON object of policy fields.")]),
        ("[1, 2]", [("sizing", "sizing must be 'auto' or 'custom', in a JSON object of policy fields.")]),
        ("{not json", [("sizing", "sizing must be 'auto' or 'custom', in a JSON object of policy fields.")]),
    ],
)
def test_bodies_that_are_not_policies_get_violations_too(body, expected):
    assert messages(validate_custom(body, train_context=8192, devices=DEVICES)) == expected


def test_parse_policy_raises_plan_error_with_the_violations():
    with pytest.raises(PlanError) as caught:
        parse_policy(custom(slots=None))
    assert caught.value.violations == (Violation("slots", "slots must be a whole number of slots, got None."),)
    assert "slots must be a whole number of slots" in str(caught.value)
    with pytest.raises(PlanError):
        parse_policy(42)  # type: ignore[arg-type]
    policy = AutoPolicy(fit_target_mib=100)
    assert parse_policy(policy) is policy


def test_custom_validation_refuses_an_automatic_policy():
    expected = [("sizing", "sizing must be 'custom' here; an automatic policy has no sizes to check.")]
    assert messages(validate_custom(AutoPolicy(), train_context=8192, devices=DEVICES)) == expected  # type: ignore[arg-type]
    assert messages(validate_custom({"sizing": "auto"}, train_context=8192, devices=DEVICES)) == expected


def test_an_ill_typed_field_does_not_hide_the_others_rules():
    # A form with one field not yet a number still shows the rules the other fields break.
    body = custom(context_per_slot=1000, slots="abc", fit_target_mib=-5, extra=1)
    assert [v.field for v in validate_custom(body, train_context=8192, devices=DEVICES)] == [
        "fit_target_mib",
        "context_per_slot",
        "slots",
        "extra",
    ]
    assert messages(
        validate_custom(json.dumps(custom(context_per_slot=9000, cache_type="q4")), train_context=8192, devices=DEVICES)
    ) == [
        ("context_per_slot", "context_per_slot must be a positive multiple of 256 tokens, got 9000; try 8192."),
        ("context_per_slot", "context_per_slot (9000 tokens) exceeds the model's training context of 8192 tokens."),
        ("cache_type", "cache_type must be 'f16' or 'q8_0' (the planner never goes below Q8_0), got 'q4'."),
    ]

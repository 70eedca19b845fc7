from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from qiip_core import PlanError
from qiip_core.engines.llamacpp import launch_spec_for
from qiip_core.planner import (
    FIT_SLACK_MIB,
    MAX_SLOTS,
    AutoPolicy,
    CustomPolicy,
    DeviceMemory,
    Plan,
    PythonEstimator,
    fits,
    plan,
)
from qiip_core.planner._types import ceil_step

from .conftest import LinearEstimator, cpu, gpu, shape


def brute_force(
    est: LinearEstimator, devices: list[DeviceMemory], train: int, target: int, cache: str
) -> tuple[int, int] | None:
    """The best automatic sizing by trying every candidate: the answer the searches must find."""

    def ok(context: int, slots: int) -> bool:
        aggregate = ceil_step(context * slots)
        return all(
            est.total(aggregate, cache) * share + target + FIT_SLACK_MIB <= d.free_mib
            for d, share in zip(devices, est.shares, strict=True)
        )

    floor = min(4096, train)
    if ok(train, 1):
        context = train
    else:
        fitting = [c for c in range(floor, train, 256) if ok(c, 1)]
        if not fitting:
            return None
        context = max(fitting)
    return context, max(s for s in range(1, MAX_SLOTS + 1) if ok(context, s))


def expected_plan(
    est: LinearEstimator, devices: list[DeviceMemory], train: int, target: int
) -> tuple[int, int, str] | None:
    found = brute_force(est, devices, train, target, "f16")
    if found is not None:
        return (*found, "f16")
    found = brute_force(est, devices, train, target, "q8_0")
    return None if found is None else (*found, "q8_0")


@pytest.mark.parametrize("free", [1700, 1800, 2000, 2500, 4000, 4700, 5000, 8000, 20000, 50000, 300_000, 10**7])
@pytest.mark.parametrize("train", [2048, 3000, 8192, 32768])
def test_automatic_plan_is_the_best_sizing_that_fits(free, train):
    est = LinearEstimator()
    devices = [gpu(0, free, total_mib=10**7)]
    expected = expected_plan(est, devices, train, 512)
    if expected is None:
        with pytest.raises(PlanError, match="does not fit even with one slot"):
            plan(shape(n_ctx_train=train), devices, AutoPolicy(), estimator=est)
        return
    result = plan(shape(n_ctx_train=train), devices, AutoPolicy(), estimator=est)
    assert (result.context_per_slot, result.slots, result.cache_type_k) == expected
    assert result.aggregate_context == ceil_step(result.context_per_slot * result.slots)
    assert result.slot_context_limit == min(train, result.aggregate_context)
    assert result.flash_attn == ("auto" if result.cache_type_k == "f16" else "on")
    assert result.cache_type_v == result.cache_type_k
    assert fits(result.estimate, devices, 512)
    # Every candidate is estimated once.
    assert len(est.calls) == len(set(est.calls)) == result.tried


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.integers(min_value=1000, max_value=400_000), min_size=1, max_size=4),
    weights=st.lists(st.integers(min_value=1, max_value=10), min_size=4, max_size=4),
    train=st.integers(min_value=300, max_value=200_000),
    target=st.integers(min_value=0, max_value=2048),
)
def test_the_searches_agree_with_trying_everything(free, weights, train, target):
    shares = tuple(w / sum(weights[: len(free)]) for w in weights[: len(free)])
    est = LinearEstimator(shares=shares)
    devices = [gpu(i, f, total_mib=10**7) for i, f in enumerate(free)]
    expected = expected_plan(est, devices, train, target)
    try:
        result = plan(shape(n_ctx_train=train), devices, AutoPolicy(fit_target_mib=target), estimator=est)
    except PlanError:
        assert expected is None
        return
    assert (result.context_per_slot, result.slots, result.cache_type_k) == expected
    # The target is kept on every device.
    for device, planned in zip(devices, result.estimate.devices, strict=True):
        assert planned.total_mib + target + FIT_SLACK_MIB <= device.free_mib


def test_q8_0_only_when_f16_cannot_fit_one_slot_at_the_floor():
    est = LinearEstimator()
    # F16 at 4096 tokens: 1000 + 2048 + 100 + 4.1 = 3152 MiB; Q8_0: 2192 MiB; with 516 MiB kept free.
    devices = [gpu(0, 3000)]
    result = plan(shape(n_ctx_train=32768), devices, AutoPolicy(), estimator=est)
    assert (result.cache_type_k, result.cache_type_v, result.flash_attn) == ("q8_0", "q8_0", "on")
    tried = [(agg, cache, fa) for agg, _, cache, fa in est.calls]
    assert tried[:2] == [(32768, "f16", "auto"), (4096, "f16", "auto")]  # train, then the floor, with F16
    assert all(cache == "q8_0" and fa == "on" for _, cache, fa in tried[2:])


def test_never_below_q8_0():
    est = LinearEstimator()
    with pytest.raises(PlanError) as caught:
        plan(shape(), [gpu(0, 2000)], AutoPolicy(), estimator=est)
    message = str(caught.value)
    assert "does not fit even with one slot of 4096 tokens and a q8_0 K/V cache" in message
    assert (
        "GPU 0 (GPU-0) needs 2,708 MiB (model 1,000 + K/V 1,088 + compute 104 + output 0 + target 512 + 4)" in message
    )
    assert "but has 2,000 MiB free" in message
    assert caught.value.violations == ()


def test_a_model_whose_heads_q8_0_cannot_store_stops_at_f16():
    est = LinearEstimator()
    with pytest.raises(PlanError, match="a f16 K/V cache"):
        plan(shape(n_embd=64, n_head=4), [gpu(0, 3000)], AutoPolicy(), estimator=est)
    assert {cache for _, _, cache, _ in est.calls} == {"f16"}


def test_the_fullest_device_decides():
    est = LinearEstimator(shares=(0.5, 0.5))
    roomy, tight = gpu(0, 80000), gpu(1, 3000)
    result = plan(shape(n_ctx_train=8192), [roomy, tight], AutoPolicy(fit_target_mib=512), estimator=est)
    second = result.estimate.devices[1]
    assert second.total_mib + 512 + FIT_SLACK_MIB <= tight.free_mib
    more = est.total(ceil_step(result.context_per_slot * (result.slots + 1)), "f16") / 2
    assert more + 512 + FIT_SLACK_MIB > tight.free_mib


def test_training_contexts_below_the_floor_and_off_the_grid():
    est = LinearEstimator(model_mib=10, compute_mib=10)
    result = plan(shape(n_ctx_train=1000), [gpu(0, 100_000, total_mib=10**6)], AutoPolicy(), estimator=est)
    # 99,484 MiB to spend at 0.501 MiB per cell beyond 20: 198 slots of 1000 tokens, rounded up to 198,144 cells.
    assert result.context_per_slot == 1000 and result.slots == 198
    assert result.aggregate_context == 198_144 and result.slot_context_limit == 1000


def test_a_custom_policy_that_fits():
    est = LinearEstimator()
    policy = CustomPolicy(fit_target_mib=512, context_per_slot=4096, slots=3, cache_type="q8_0")
    result = plan(shape(), [gpu(0, 10000)], policy, estimator=est)
    assert (result.context_per_slot, result.slots, result.aggregate_context) == (4096, 3, 12288)
    assert (result.cache_type_k, result.flash_attn, result.estimator_overrun_used) == ("q8_0", "on", False)
    assert est.calls == [(12288, 3, "q8_0", "on")]
    assert result.requested() == policy.model_dump()


def test_a_custom_policy_that_does_not_fit_fails_unless_overrun_is_allowed():
    est = LinearEstimator()
    body = {"sizing": "custom", "fit_target_mib": 512, "context_per_slot": 8192, "slots": 4, "cache_type": "f16"}
    with pytest.raises(PlanError) as caught:
        plan(shape(), [gpu(0, 10000)], body, estimator=est)
    assert str(caught.value).startswith("The custom sizing (4 slots of 8192 tokens, f16 K/V) does not fit: GPU 0")
    assert "allow_estimator_overrun" in str(caught.value)
    result = plan(shape(), [gpu(0, 10000)], body | {"allow_estimator_overrun": True}, estimator=est)
    assert result.estimator_overrun_used and result.effective()["estimator_overrun_used"] is True


def test_an_invalid_policy_carries_its_violations():
    with pytest.raises(PlanError) as caught:
        plan(shape(), [gpu(0, 10000)], {"sizing": "custom", "fit_target_mib": 512}, estimator=LinearEstimator())
    assert [v.field for v in caught.value.violations] == ["context_per_slot", "slots", "cache_type"]
    with pytest.raises(PlanError) as caught:
        plan(shape(), [gpu(0, 10000)], AutoPolicy(fit_target_mib=90000), estimator=LinearEstimator())
    assert [v.field for v in caught.value.violations] == ["fit_target_mib"]


def test_no_devices():
    with pytest.raises(PlanError, match="no device to plan on"):
        plan(shape(), [], AutoPolicy(), estimator=LinearEstimator())


def planned(devices: list[DeviceMemory]) -> Plan:
    return plan(shape(), devices, AutoPolicy(fit_target_mib=100), estimator=PythonEstimator())


def test_the_record_and_the_log_line_of_a_cpu_plan():
    result = planned([cpu(200, total_mib=1000)])
    assert result.cpu_mode and result.estimator == "python"
    effective = result.effective()
    assert effective == {
        "train_context": 8192,
        "context_per_slot": result.context_per_slot,
        "slot_context_limit": min(8192, result.aggregate_context),
        "slots": result.slots,
        "aggregate_context": result.aggregate_context,
        "cache_type_k": result.cache_type_k,
        "cache_type_v": result.cache_type_v,
        "flash_attn": result.flash_attn,
        "kv_unified": True,
        "gpu_layers": 0,
        "total_layers": 5,
        "estimator_overrun_used": False,
        "device_mode": "cpu",
        "layer_offload": "not applicable: CPU mode runs every layer on the host, no layer is offloaded",
    }
    assert result.summary() == (
        f"qiip_fit_plan: sizing=auto train_context=8192 context_per_slot={result.context_per_slot} "
        f"slots={result.slots} aggregate_context={result.aggregate_context} fit_target_mib=100 "
        f"cache_type_k={result.cache_type_k} cache_type_v={result.cache_type_v} flash_attn={result.flash_attn} "
        "estimator_overrun_used=false"
    )


def test_launch_specs_spell_out_the_plan():
    cpu_plan = planned([cpu(200, total_mib=1000)])
    spec = launch_spec_for(cpu_plan, model_path=Path("/m.gguf"), alias="m", port=8123, threads=1)
    argv = spec.argv(Path("llama-server"))
    assert argv[argv.index("--ctx-size") + 1] == str(cpu_plan.aggregate_context)
    assert argv[argv.index("--parallel") + 1] == str(cpu_plan.slots)
    assert argv[argv.index("--cache-type-k") + 1] == cpu_plan.cache_type_k
    assert argv[argv.index("--flash-attn") + 1] == cpu_plan.flash_attn
    assert argv[argv.index("--gpu-layers") + 1] == "0"
    assert argv[argv.index("--log-verbosity") + 1] == "4"
    assert "--kv-unified" in argv and "--metrics" in argv and argv[argv.index("--fit") + 1] == "off"
    gpu_plan = planned([gpu(0, 200)])
    assert gpu_plan.gpu_layers == 5 and gpu_plan.effective()["layer_offload"] == "5/5 layers on GPU"
    assert launch_spec_for(gpu_plan, model_path=Path("/m.gguf"), alias="m", embeddings=True).gpu_layers == "all"

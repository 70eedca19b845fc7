"""Interleaved sliding-window attention, on real llama-server processes: Gemma 2 and Gemma 3 test models, and the
real published Gemma 3 270M.

llama.cpp gives these models two K/V caches (`llama_kv_cache_iswa`): the full layers' with `--ctx-size` cells and
the sliding-window layers' with `pad256(window × slots + ubatch)`. Each is estimated and verified on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qiip_core.engines.llamacpp import launch_spec_for, make_test_gguf, read_gguf_metadata
from qiip_core.nodes import LlamaCppRuntime
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    FitParamsEstimator,
    ModelShape,
    Plan,
    PythonEstimator,
    estimate,
    plan,
    read_devices,
    verify_runtime,
)
from tests.support.planner import assert_estimate_matches_log, load_once, running, synthetic_cpu

pytestmark = pytest.mark.integration

# name: (architecture, options); every model 6 × 128 wide, 4 heads, 2 K/V heads, 8192 tokens of training context.
MODELS = {
    "gemma2": ("gemma2", {"sliding_window": 256}),  # every other layer slides
    "gemma3": ("gemma3", {"sliding_window": 128}),  # five of six
    "gemma3-dense": ("gemma3", {}),  # no window: one cache, Gemma 3's graph
    "gemma3-wide-heads": ("gemma3", {"sliding_window": 512, "head_dim": 64, "swa_pattern": 3}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelShape]]:
    directory = tmp_path_factory.mktemp("swa-models")
    found = {}
    for name, (architecture, options) in MODELS.items():
        path = make_test_gguf(
            directory / f"{name}.gguf",
            architecture=architecture,
            n_layers=6,
            n_embd=128,
            n_head=4,
            n_head_kv=2,
            n_ctx_train=8192,
            n_vocab=2000,
            n_ff=384,
            options=options,
        )[0]
        found[name] = (path, ModelShape.from_metadata(read_gguf_metadata(path)))
    return found


def test_the_generated_models_have_the_layer_patterns_llama_cpp_gives_them(models):
    assert models["gemma2"][1].swa_layers == (True, False) * 3
    assert models["gemma3"][1].swa_layers == (True,) * 5 + (False,)
    assert models["gemma3-wide-heads"][1].swa_layers == (True, True, False) * 2
    assert models["gemma3-dense"][1].memory == "kv" and not models["gemma3-dense"][1].swa_layers
    assert models["gemma3-wide-heads"][1].head_dim_k == 64


# (model, --ctx-size, --parallel, --flash-attn, cache type)
MEASURED = [
    ("gemma2", 16384, 2, "auto", "f16"),
    ("gemma2", 4096, 1, "off", "f16"),
    ("gemma2", 8192, 3, "on", "q8_0"),
    ("gemma3", 2048, 8, "off", "f16"),
    ("gemma3", 16384, 4, "on", "q8_0"),
    ("gemma3", 512, 1, "auto", "f16"),
    ("gemma3-dense", 8192, 3, "auto", "f16"),
    ("gemma3-wide-heads", 32768, 5, "on", "q8_0"),
    ("gemma3-wide-heads", 1024, 16, "off", "f16"),
]


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "cache"), MEASURED)
async def test_both_caches_and_the_compute_buffer_are_within_2_percent(
    llama_server_binary, models, tmp_path, name, ctx, slots, fa, cache
):
    path, shape = models[name]
    log = tmp_path / "server.log"
    await load_once(llama_server_binary, path, log, ctx=ctx, slots=slots, flash_attn=fa, cache=cache)
    result = estimate(
        shape, aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=fa, devices=[synthetic_cpu(10**6)]
    )
    assert_estimate_matches_log(result, log)


# The real model: 18 layers, a 512-token window on 15 of them, head width 256, a 262,144-token vocabulary, Q4_K_M
# weights (on AVX2 hosts llama.cpp keeps a repacked copy of the Q4_K ones).
GEMMA_MEASURED = [
    (16384, 2, "auto", "f16"),
    (4096, 1, "off", "f16"),
    (8192, 3, "on", "q8_0"),
    (2048, 8, "off", "f16"),
    (65536, 4, "on", "q8_0"),
]


@pytest.mark.parametrize(("ctx", "slots", "fa", "cache"), GEMMA_MEASURED)
async def test_the_real_gemma_is_estimated_within_2_percent(
    llama_server_binary, gemma_gguf, tmp_path, ctx, slots, fa, cache
):
    shape = ModelShape.from_metadata(read_gguf_metadata(gemma_gguf))
    assert (shape.architecture, shape.memory, shape.swa_window, sum(shape.swa_layers)) == ("gemma3", "iswa", 512, 15)
    log = tmp_path / "server.log"
    await load_once(llama_server_binary, gemma_gguf, log, ctx=ctx, slots=slots, flash_attn=fa, cache=cache)
    devices = read_devices(allow_cpu=True)  # the real host: its repacking decides the weights
    result = estimate(shape, aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=fa, devices=devices)
    assert_estimate_matches_log(result, log)


async def _launch_and_verify(binary: Path, path: Path, p: Plan, log: Path) -> LlamaCppRuntime:
    spec = launch_spec_for(p, model_path=path, alias="planned", threads=1)
    async with running(binary, spec, log) as server:
        record = await verify_runtime(
            p, endpoint=server.endpoint, log_path=log, alias="planned", devices_after=read_devices(allow_cpu=True)
        )
    assert record.effective == p.effective() and record.unverified == []
    assert record.architecture == p.architecture
    assert [m["kind"] for m in record.memory] == [c.kind for c in p.caches]
    return record


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3-dense"])
async def test_plans_for_generated_models_run_and_verify(llama_server_binary, models, tmp_path, name):
    path, shape = models[name]
    p = plan(shape, [synthetic_cpu(400)], AutoPolicy(fit_target_mib=64), estimator=PythonEstimator())
    record = await _launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log")
    assert_estimate_matches_log(p.estimate, tmp_path / "server.log")
    assert len(record.memory) == (1 if name == "gemma3-dense" else 2)


async def test_the_real_gemma_runs_an_automatic_and_a_custom_plan(llama_server_binary, gemma_gguf, tmp_path):
    shape = ModelShape.from_metadata(read_gguf_metadata(gemma_gguf))
    # Memory for the whole 32,768-token context at one slot, and a few more slots: the search decides.
    auto = plan(shape, [synthetic_cpu(1000)], AutoPolicy(fit_target_mib=128), estimator=PythonEstimator())
    assert auto.context_per_slot == 32768 and auto.slots >= 2
    record = await _launch_and_verify(llama_server_binary, gemma_gguf, auto, tmp_path / "auto.log")
    full, window = record.memory
    assert (full["kind"], full["cells"], full["layers"]) == ("kv", auto.aggregate_context, 3)
    assert (window["kind"], window["layers"]) == ("kv_swa", 15)
    assert window["cells"] == -(-(512 * auto.slots + 512) // 256) * 256
    custom = plan(
        shape,
        read_devices(allow_cpu=True),
        CustomPolicy(fit_target_mib=512, context_per_slot=4096, slots=3, cache_type="q8_0"),
        estimator=PythonEstimator(),
    )
    await _launch_and_verify(llama_server_binary, gemma_gguf, custom, tmp_path / "custom.log")
    assert_estimate_matches_log(custom.estimate, tmp_path / "custom.log")


async def test_llama_fit_params_plans_the_real_gemma_with_both_caches(llama_server_binary, gemma_gguf, tmp_path):
    fit_params = llama_server_binary.with_name("llama-fit-params")
    if not fit_params.exists():
        pytest.skip("llama-fit-params is not installed next to llama-server")
    shape = ModelShape.from_metadata(read_gguf_metadata(gemma_gguf))
    policy = CustomPolicy(fit_target_mib=512, context_per_slot=8192, slots=4, cache_type="f16")
    devices = read_devices(allow_cpu=True)
    fitted = plan(shape, devices, policy, estimator=FitParamsEstimator(fit_params, gemma_gguf))
    exact = plan(shape, devices, policy, estimator=PythonEstimator())
    # At --parallel 1 llama-fit-params sizes one window; the context is raised to the four windows llama-server holds.
    assert fitted.estimate.devices[0].context_mib >= exact.estimate.devices[0].context_mib
    assert fitted.caches == exact.caches
    await _launch_and_verify(llama_server_binary, gemma_gguf, fitted, tmp_path / "server.log")

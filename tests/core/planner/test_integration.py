"""Plans run by real llama-server processes on generated models, verified, and measured against the estimates.

Every server runs with `--threads 1` on loopback. Memory is planned against synthetic CPU devices so that the
search lands on interesting sizings (a context between the floor and the training context, a handful of slots,
the Q8_0 fallback); the server itself has the machine's memory, and `verify_runtime` reads the real devices.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from qiip_core import VerificationError
from qiip_core.config import load_settings
from qiip_core.engines.llamacpp import (
    LlamaCppInstaller,
    launch_spec_for,
)
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    DeviceMemory,
    FitParamsEstimator,
    ModelShape,
    PythonEstimator,
    estimate,
    plan,
    read_devices,
    verify_runtime,
)
from tests.support.llama_server import running
from tests.support.planner import (
    ModelRow,
    assert_load_matches_estimate,
    budget,
    generated_models,
    launch_and_verify,
    synthetic_cpu,
)

pytestmark = pytest.mark.integration

# name: (architecture, blocks, width, heads, K/V heads, training context, vocabulary, FFN width, options)
MODELS: dict[str, ModelRow] = {
    "gqa2": ("llama", 4, 256, 4, 2, 8192, 2000, 1024, {}),
    "tiny": ("llama", 2, 64, 4, 4, 2048, 512, 256, {}),  # head 16: no Q8_0
    "wide": ("llama", 6, 384, 6, 2, 16384, 8000, 1536, {}),
    "mqa": ("llama", 3, 512, 8, 1, 4096, 32000, 1408, {}),
    "deep": ("llama", 8, 128, 2, 2, 32768, 300, 512, {}),
    "head128": ("llama", 2, 256, 2, 1, 1024, 20000, 640, {}),  # training context below the 4096 floor
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelShape]]:
    directory = tmp_path_factory.mktemp("planner-models")
    return generated_models(directory, MODELS)


@pytest.fixture(scope="session")
def fit_params_binary(llama_server_binary: Path) -> Path:
    installed = LlamaCppInstaller(load_settings().engines.llamacpp).find_installed()
    if installed is None or installed.fit_params is None:
        pytest.skip("llama-fit-params is not installed next to llama-server")
    return installed.fit_params


# (model, --ctx-size, --parallel, --flash-attn, cache type): every shape; F16 and Q8_0; flash attention on, off and
# auto; contexts from 256 to 65536; slot counts that divide the micro-batch and that do not.
MEASURED = [
    ("gqa2", 256, 1, "auto", "f16"),
    ("gqa2", 8192, 2, "off", "f16"),
    ("gqa2", 16384, 100, "on", "q8_0"),
    ("tiny", 2048, 8, "off", "f16"),
    ("tiny", 65536, 3, "auto", "f16"),
    ("wide", 4096, 1, "on", "q8_0"),
    ("wide", 32768, 16, "off", "f16"),
    ("mqa", 1024, 256, "auto", "f16"),
    ("mqa", 12288, 6, "on", "q8_0"),
    ("deep", 32768, 5, "off", "f16"),
    ("deep", 65536, 64, "on", "q8_0"),
    ("head128", 2048, 2, "on", "f16"),
    ("head128", 8192, 7, "on", "q8_0"),
    ("head128", 4096, 1, "off", "f16"),
]


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "cache"), MEASURED)
async def test_estimates_are_within_2_percent_of_the_log(
    llama_server_binary, models, tmp_path, name, ctx, slots, fa, cache
):
    path, shape = models[name]
    log = tmp_path / "server.log"
    await assert_load_matches_estimate(
        llama_server_binary, path, shape, log, ctx=ctx, slots=slots, flash_attn=fa, cache=cache
    )


def fits_on(shape: ModelShape, device: DeviceMemory, context: int, slots: int, cache: str) -> bool:
    return budget(shape, context=context, slots=slots, cache=cache) - 1 <= device.free_mib


@pytest.mark.parametrize(
    ("name", "sizing", "cache", "context"),
    [
        # The training context fits at one slot; then as many slots as fit.
        ("gqa2", (8192, 3, "f16"), "f16", "train"),
        ("tiny", (2048, 24, "f16"), "f16", "train"),
        # A training context below the 4096 floor, and 5 slots of it off the 256 grid.
        ("head128", (1024, 5, "f16"), "f16", "train"),
        # The training context does not fit at one slot: binary search between the floor and 32768.
        ("deep", (12288, 1, "f16"), "f16", "searched"),
        # F16 cannot fit one slot at the floor: Q8_0 with flash attention on.
        ("wide", (4096, 1, "q8_0"), "q8_0", "searched"),
        ("mqa", (4096, 1, "q8_0"), "q8_0", "train"),
    ],
)
async def test_automatic_plans_run_as_planned(llama_server_binary, models, tmp_path, name, sizing, cache, context):
    path, shape = models[name]
    free = budget(shape, context=sizing[0], slots=sizing[1], cache=sizing[2])
    if cache == "q8_0":
        assert free < budget(shape, context=min(4096, shape.n_ctx_train), slots=1, cache="f16") - 1
    device = synthetic_cpu(free)
    p = plan(shape, [device], AutoPolicy(), estimator=PythonEstimator())
    assert p.cache_type_k == p.cache_type_v == cache and p.flash_attn == ("auto" if cache == "f16" else "on")
    train, floor = shape.n_ctx_train, min(4096, shape.n_ctx_train)
    if context == "train":
        assert p.context_per_slot == train
    else:
        assert floor <= p.context_per_slot < train and p.context_per_slot % 256 == 0
        assert not fits_on(shape, device, p.context_per_slot + 256, 1, cache)
    # The best sizing: it fits, one more slot would not.
    assert fits_on(shape, device, p.context_per_slot, p.slots, cache)
    assert p.slots == 256 or not fits_on(shape, device, p.context_per_slot, p.slots + 1, cache)
    if p.context_per_slot == sizing[0]:
        assert p.slots >= sizing[1]
    await launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log")


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("gqa2", CustomPolicy(fit_target_mib=512, context_per_slot=2048, slots=7, cache_type="q8_0")),
        ("deep", CustomPolicy(fit_target_mib=256, context_per_slot=32768, slots=2, cache_type="f16")),
    ],
)
async def test_custom_plans_run_as_planned(llama_server_binary, models, tmp_path, name, policy):
    path, shape = models[name]
    devices = read_devices(allow_cpu=True)
    p = plan(shape, devices, policy, estimator=PythonEstimator())
    assert p.aggregate_context == -(-policy.context_per_slot * policy.slots // 256) * 256
    await launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log")


async def test_an_embeddings_server_is_planned_for_its_outputs(llama_server_binary, models, tmp_path):
    path, shape = models["mqa"]
    p = plan(shape, [synthetic_cpu(10**4)], AutoPolicy(), estimator=PythonEstimator(embeddings=True))
    await launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log", embeddings=True)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"slots": 3}, "slots"),
        ({"cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on"}, "cache_type_k"),
        # Each slot still may use 8192 (the training context): only the log's n_ctx tells.
        ({"ctx_size": 8192}, "aggregate_context"),
        ({"alias": "someone-else"}, "alias"),
    ],
)
async def test_a_launch_that_differs_from_its_plan_is_caught(llama_server_binary, models, tmp_path, change, field):
    path, shape = models["gqa2"]
    p = plan(
        shape,
        [synthetic_cpu(budget(shape, context=8192, slots=2, cache="f16"))],
        AutoPolicy(),
        estimator=PythonEstimator(),
    )
    assert (p.slots, p.aggregate_context, p.slot_context_limit) == (2, 16384, 8192)
    spec = replace(launch_spec_for(p, model_path=path, alias="planned", threads=1), **change)
    log = tmp_path / "server.log"
    async with running(llama_server_binary, spec, log) as server:
        with pytest.raises(VerificationError) as caught:
            await verify_runtime(
                p, endpoint=server.endpoint, log_path=log, alias="planned", devices_after=read_devices(allow_cpu=True)
            )
    error = caught.value
    assert error.field == field and error.expected != error.actual
    assert f"{field} (" in str(error) and "the plan says" in str(error)


async def test_llama_fit_params_as_the_authority(llama_server_binary, fit_params_binary, models, tmp_path):
    path, shape = models["wide"]
    estimator = FitParamsEstimator(fit_params_binary, path)
    device = synthetic_cpu(budget(shape, context=16384, slots=2, cache="f16") + 8)
    raw = FitParamsEstimator(fit_params_binary, path, compute_floor=False).estimate(
        shape, aggregate_context=16384, slots=2, cache_type="f16", flash_attn="auto", devices=[device]
    )
    python = estimate(shape, aggregate_context=16384, slots=2, cache_type="f16", flash_attn="auto", devices=[device])
    # Whole MiB, floored: weights and K/V agree with ours; its compute reserves 512 logit rows instead of 2.
    assert raw.devices[0].model_mib == math.floor(python.devices[0].model_mib)
    assert raw.devices[0].context_mib == math.floor(python.devices[0].context_mib)
    assert raw.devices[0].compute_mib >= math.floor(python.devices[0].compute_mib)
    p = plan(shape, [device], AutoPolicy(), estimator=estimator)
    assert p.estimator == "llama-fit-params" and p.context_per_slot == 16384 and p.slots >= 1
    await launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log")

"""Recurrent and hybrid models (LFM2, Granite 4 hybrid, Mamba-2, Mamba) run by real llama-server processes.

Every estimate (each cache the server logs, the compute buffer, the weights) is compared with the log, and one
plan per family is launched from `launch_spec_for` and verified. Servers run with `--threads 1` on loopback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qiip_core.planner import (
    AutoPolicy,
    ModelShape,
    PythonEstimator,
    plan,
)
from tests.support.planner import (
    ModelRow,
    assert_estimate_matches_log,
    assert_load_matches_estimate,
    budget,
    generated_models,
    launch_and_verify,
    running_plan,
    synthetic_cpu,
)

pytestmark = pytest.mark.integration

# name: (architecture, blocks, width, heads, K/V heads, training context, vocabulary, FFN width, options)
MODELS: dict[str, ModelRow] = {
    # Blocks 2 and 5 attend, the others are short convolutions of 3 tokens.
    "lfm2": ("lfm2", 6, 256, 4, 2, 8192, 2000, 768, {"attention_period": 3}),
    # Every attention block slides (llama_memory_hybrid_iswa): the full cache has no layer at all.
    "lfm2-swa": ("lfm2", 6, 256, 4, 2, 8192, 2000, 768, {"attention_period": 3, "sliding_window": 512}),
    # Blocks 2 and 5 attend, the others are Mamba-2 mixers (16 heads, a 16-wide state); Granite's scales.
    "granite": (
        "granitehybrid",
        6,
        256,
        4,
        2,
        8192,
        2000,
        768,
        {"attention_period": 3, "residual_scale": 0.22, "logit_scale": 8.0},
    ),
    # Granite 4.0-H's layout: no rotary embedding, one attention block of five, a wider state in 2 groups.
    "granite-nope": (
        "granitehybrid",
        5,
        384,
        6,
        2,
        16384,
        3000,
        1024,
        {"attention_period": 5, "ssm_state_size": 64, "ssm_group_count": 2, "ssm_head_count": 12, "rope": False},
    ),
    # LFM2 as published: the output projection is the token embedding; a 4-token convolution.
    "lfm2-tied": ("lfm2", 6, 256, 4, 2, 8192, 2000, 768, {"attention_period": 2, "l_cache": 4, "tied_output": True}),
    "mamba2": ("mamba2", 4, 256, 4, 4, 8192, 2000, 1024, {"ssm_state_size": 32, "ssm_head_count": 8}),
    "mamba": ("mamba", 4, 256, 4, 4, 8192, 2000, 1024, {}),
    # Falcon-Mamba: Δ, B and C are RMS-normalised before the scan.
    "falcon-mamba": ("mamba", 3, 192, 4, 4, 8192, 1000, 768, {"dt_b_c_rms": True, "ssm_state_size": 8}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelShape]]:
    directory = tmp_path_factory.mktemp("recurrent-models")
    return generated_models(directory, MODELS)


# (model, --ctx-size, --parallel, --flash-attn, cache type): per family F16 and Q8_0 (64-wide heads), flash
# attention on, off and auto, 1, 3 and 8 slots (3 does not divide the 512-token micro-batch), contexts 512-16384.
MEASURED = [
    ("lfm2", 4096, 1, "auto", "f16"),
    ("lfm2", 512, 8, "off", "f16"),
    ("lfm2", 16384, 3, "off", "f16"),
    ("lfm2", 16384, 8, "on", "q8_0"),
    ("lfm2", 2048, 3, "on", "f16"),
    ("lfm2-swa", 8192, 3, "auto", "f16"),
    ("lfm2-swa", 16384, 8, "on", "q8_0"),
    ("granite", 4096, 1, "off", "f16"),
    ("granite", 8192, 8, "auto", "f16"),
    ("granite", 16384, 8, "on", "q8_0"),
    ("granite", 512, 3, "off", "f16"),
    ("granite-nope", 4096, 3, "auto", "f16"),
    ("granite-nope", 16384, 8, "on", "q8_0"),
    ("granite-nope", 1024, 1, "off", "f16"),
    ("mamba2", 4096, 1, "auto", "f16"),
    ("mamba2", 512, 8, "off", "f16"),
    ("mamba2", 16384, 3, "on", "f16"),
    ("lfm2-tied", 4096, 1, "off", "f16"),
    ("lfm2-tied", 16384, 3, "on", "q8_0"),
    ("mamba", 4096, 1, "auto", "f16"),
    ("mamba", 512, 8, "off", "f16"),
    ("falcon-mamba", 16384, 3, "on", "f16"),
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


@pytest.mark.parametrize(("name", "slots"), [("lfm2", 3), ("lfm2-swa", 2), ("granite", 5), ("granite-nope", 2)])
async def test_automatic_plans_of_hybrids_run_as_planned(llama_server_binary, models, tmp_path, name, slots):
    path, shape = models[name]
    device = synthetic_cpu(budget(shape, context=shape.n_ctx_train, slots=slots))
    p = plan(shape, [device], AutoPolicy(), estimator=PythonEstimator())
    assert p.context_per_slot == shape.n_ctx_train and p.slots >= slots and p.cache_type_k == "f16"
    await launch_and_verify(llama_server_binary, path, p, tmp_path / "server.log")


async def test_an_automatic_plan_of_a_pure_recurrent_model_runs_as_planned(llama_server_binary, models, tmp_path):
    path, shape = models["mamba2"]
    device = synthetic_cpu(budget(shape, context=shape.n_ctx_train, slots=4))
    p = plan(shape, [device], AutoPolicy(), estimator=PythonEstimator())
    assert p.context_per_slot == shape.n_ctx_train and p.slots >= 4
    log = tmp_path / "server.log"
    async with running_plan(llama_server_binary, path, p, log) as (_, record):
        pass
    # No K/V cache at all: the one cache is the recurrent state, one cell per slot.
    assert record.effective == p.effective() and record.unverified == []
    assert [(m["kind"], m["cells"]) for m in record.memory] == [("recurrent", p.slots)]
    assert_estimate_matches_log(p.estimate, log)

"""Mixture-of-experts models (qwen3moe, Mixtral-style llama, qwen2moe) run by real llama-server processes, and
the planner's estimates measured against what they log.

Each model is a generated test model (`engines/llamacpp/testmodels/_moe.py`); the server runs it on the CPU with
`--threads 1`.
Besides the three sizes (K/V, compute, weights) within 2%, the graph we rebuild must have as many nodes as the
one llama.cpp reserved (`sched_reserve: graph…: nodes = N`): the cheapest proof that the expert block is built
op for op.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from qiip_core.config import load_settings
from qiip_core.engines.llamacpp import (
    LaunchSpec,
    LlamaCppInstaller,
    read_gguf_metadata,
)
from qiip_core.planner import (
    AutoPolicy,
    ModelShape,
    PythonEstimator,
    estimate,
    parse_server_log,
    plan,
    read_cpu_repack,
)
from qiip_core.planner._compute import build_graph, is_modelled
from qiip_core.planner._graph import GraphParams
from tests.support.llama_server import running
from tests.support.planner import (
    ModelRow,
    assert_close,
    assert_estimate_matches_log,
    assert_load_matches_estimate,
    budget,
    generated_models,
    running_plan,
    synthetic_cpu,
)

pytestmark = pytest.mark.integration

# name: (architecture, blocks, width, heads, K/V heads, training context, vocabulary, FFN width, expert options)
MODELS: dict[str, ModelRow] = {
    # Qwen3-30B-A3B in miniature: 16 experts, 4 per token, experts a quarter of the FFN width; head 64 (rotations
    # with Q8_0).
    "q3moe": ("qwen3moe", 3, 256, 4, 2, 16384, 2000, 1024, {"n_expert": 16, "n_expert_used": 4, "n_ff_expert": 256}),
    # 8 of 32 wide experts per token: the expert intermediates dominate the compute buffer.
    "q3moe-wide": (
        "qwen3moe",
        2,
        256,
        8,
        2,
        4096,
        1000,
        1024,
        {"n_expert": 32, "n_expert_used": 8, "n_ff_expert": 512},
    ),
    # Mixtral in miniature: 8 experts of the FFN width, 2 per token.
    "mixtral": ("llama", 4, 256, 8, 2, 8192, 2000, 512, {"n_expert": 8, "n_expert_used": 2}),
    # One expert per token: the sum over experts is a single cont.
    "mixtral-top1": ("llama", 2, 128, 2, 1, 4096, 500, 768, {"n_expert": 4, "n_expert_used": 1}),
    # A shared expert next to the routed ones, weights not renormalised.
    "q2moe": (
        "qwen2moe",
        2,
        256,
        4,
        2,
        8192,
        1000,
        512,
        {"n_expert": 8, "n_expert_used": 2, "n_ff_expert": 256, "n_ff_shared_expert": 1024},
    ),
}

_NODES_RE = re.compile(r"sched_reserve: graph[^:]*: nodes = (\d+)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelShape]]:
    directory = tmp_path_factory.mktemp("moe-models")
    found = generated_models(directory, MODELS)
    for name, (_, shape) in found.items():
        assert shape.n_expert == MODELS[name][-1]["n_expert"] and is_modelled(shape)
    return found


def logged_nodes(log: Path) -> int:
    """Nodes of the prompt-processing graph llama.cpp reserved (the first number when pp and tg differ)."""
    found = _NODES_RE.findall(log.read_text())
    assert found, "the server did not log its reserved graph"
    return int(found[-1])


# (model, --ctx-size, --parallel, --flash-attn, cache type): F16 and Q8_0; flash attention on, off and auto; 1, 3
# and 8 slots; contexts from 512 to 16384.
MEASURED = [
    ("q3moe", 512, 1, "auto", "f16"),
    ("q3moe", 4096, 3, "off", "f16"),
    ("q3moe", 16384, 8, "on", "q8_0"),
    ("q3moe-wide", 512, 1, "on", "f16"),
    ("q3moe-wide", 2048, 8, "off", "f16"),
    ("q3moe-wide", 4096, 3, "auto", "q8_0"),
    ("mixtral", 512, 3, "off", "f16"),
    ("mixtral", 8192, 1, "on", "q8_0"),
    ("mixtral", 16384, 8, "auto", "f16"),
    ("mixtral-top1", 1024, 3, "on", "f16"),
    ("mixtral-top1", 4096, 8, "off", "f16"),
    ("q2moe", 2048, 3, "auto", "f16"),
    ("q2moe", 8192, 8, "on", "q8_0"),
    ("q2moe", 1024, 1, "off", "f16"),
]


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "cache"), MEASURED)
async def test_expert_models_are_estimated_within_2_percent(
    llama_server_binary, models, tmp_path, name, ctx, slots, fa, cache
):
    path, shape = models[name]
    log = tmp_path / "server.log"
    result = await assert_load_matches_estimate(
        llama_server_binary, path, shape, log, ctx=ctx, slots=slots, flash_attn=fa, cache=cache
    )
    params = GraphParams(aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=result.flash_attn)
    assert len(build_graph(shape, params).nodes) == logged_nodes(log)


@pytest.mark.parametrize(
    ("name", "sizing"),
    [
        ("q3moe", (4096, 3, "f16")),
        ("mixtral", (8192, 2, "f16")),
        ("q2moe", (2048, 5, "f16")),
    ],
)
async def test_planned_expert_models_run_as_planned_and_generate(llama_server_binary, models, tmp_path, name, sizing):
    path, shape = models[name]
    device = synthetic_cpu(budget(shape, context=sizing[0], slots=sizing[1], cache=sizing[2]))
    p = plan(shape, [device], AutoPolicy(), estimator=PythonEstimator())
    assert p.context_per_slot >= sizing[0] and p.slots >= 1
    log = tmp_path / "server.log"
    async with running_plan(llama_server_binary, path, p, log) as (server, record):
        async with httpx.AsyncClient(base_url=server.endpoint, trust_env=False, timeout=60) as client:
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": "planned", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8},
            )
    assert record.effective == p.effective() and record.effective["device_mode"] == "cpu"
    assert chat.status_code == 200
    assert 1 <= chat.json()["usage"]["completion_tokens"] <= 8
    assert_estimate_matches_log(p.estimate, log)


@pytest.fixture(scope="session")
def quantize_binary(llama_server_binary: Path) -> Path:
    installed = LlamaCppInstaller(load_settings().engines.llamacpp).find_installed()
    if installed is None or installed.quantize is None:
        pytest.skip("llama-quantize is not installed next to llama-server")
    return installed.quantize


@pytest.mark.parametrize(("name", "quant"), [("q3moe", "Q4_0"), ("mixtral", "Q4_K_M"), ("q2moe", "Q4_0")])
async def test_quantised_experts_are_repacked_and_unmapped(
    llama_server_binary, quantize_binary, models, tmp_path, name, quant
):
    # llama-quantize writes tensors sorted by name, so each file ends with the last block's ffn_up_exps: where the
    # CPU backend repacks it (into CPU_REPACK), it falls out of the mapped range (CPU_Mapped).
    source, _ = models[name]
    path = tmp_path / f"{name}-{quant}.gguf"
    command = [str(quantize_binary), str(source), str(path), quant]
    await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True)
    shape = ModelShape.from_metadata(read_gguf_metadata(path))
    spec = LaunchSpec(model=path, alias=name, ctx_size=2048, slots=3, flash_attn="on", gpu_layers=0, threads=1)
    log = tmp_path / "server.log"
    async with running(llama_server_binary, spec, log):
        pass
    device = replace(synthetic_cpu(10**6), repack=read_cpu_repack())
    result = estimate(shape, aggregate_context=2048, slots=3, cache_type="f16", flash_attn="on", devices=[device])
    facts = parse_server_log(log.read_text())
    (estimated,) = result.devices
    assert facts.kv_mib is not None
    assert_close(estimated.context_mib, facts.kv_mib, "K/V")
    assert_close(estimated.compute_mib, facts.compute_mib["CPU"], "compute")
    assert_close(estimated.model_mib, sum(facts.model_mib.values()), "model")
    if "CPU_REPACK" in facts.model_mib:
        assert shape.weights_bytes / 2**20 > facts.model_mib["CPU_Mapped"] + 0.1

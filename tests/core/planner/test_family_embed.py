"""Embedding models on a real llama-server: the estimate against the log, and real `/v1/embeddings` answers.

Each model is launched with `--embeddings` as `launch_spec_for` would launch it (the model's own pooling, the
micro-batch the estimate assumed), at contexts from 256 tokens to the training context, 1 to 4 slots and
flash attention on, off and auto; the weights, the compute buffer and the output buffer as allocated at start
must be within 2% of what the server logs, the rebuilt graph must have the logged number of nodes, and the
official `openai` client must get one vector of `n_embd` floats per input.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from qiip_core.engines.llamacpp import LaunchSpec, launch_spec_for
from qiip_core.planner import (
    AutoPolicy,
    CustomPolicy,
    ModelShape,
    PythonEstimator,
    estimate,
    parse_server_log,
    plan,
    read_devices,
    verify_runtime,
)
from qiip_core.planner._compute import build_graph
from qiip_core.planner._graph import GraphParams
from tests.support.llama_server import running
from tests.support.planner import ModelRow, assert_close, generated_models, synthetic_cpu

pytestmark = pytest.mark.integration

# name: (architecture, blocks, width, heads, K/V heads, training context, vocabulary, FFN width, options)
MODELS: dict[str, ModelRow] = {
    # bge-style: separate Q/K/V with biases, CLS pooling.
    "bge": ("bert", 2, 128, 4, 4, 512, 8000, 512, {}),
    # MiniLM-style: a fused QKV, mean pooling, 16-wide heads.
    "minilm": ("bert", 3, 96, 6, 6, 512, 800, 384, {"fused_qkv": True, "pooling_type": 1}),
    # nomic-embed-style: rotary, SwiGLU, mean pooling, a training context beyond the default micro-batch.
    "nomic": ("nomic-bert", 2, 128, 4, 4, 2048, 1000, 384, {}),
    # Qwen3-Embedding-style: a causal decoder with a K/V cache and Q/K norms, last-token pooling.
    "qwen3emb": ("qwen3", 2, 128, 4, 2, 4096, 16000, 384, {}),
    # A generative llama: no pooling of its own, served with mean pooling.
    "llama": ("llama", 2, 128, 4, 2, 4096, 1000, 384, {}),
}

_OUTPUT_RE = re.compile(r"(\S+)\s+output buffer size =\s*([\d.]+) MiB")
_NODES_RE = re.compile(r"sched_reserve: graph: nodes = (\d+)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelShape]]:
    directory = tmp_path_factory.mktemp("embedding-models")
    return generated_models(directory, MODELS)


async def embed(endpoint: str, texts: list[str]) -> list[list[float]]:
    """`/v1/embeddings` through the official client, one vector per text."""
    async with AsyncOpenAI(base_url=f"{endpoint}/v1", api_key="unused", max_retries=0) as client:
        answer = await client.embeddings.create(model="embed", input=texts)
    return [item.embedding for item in sorted(answer.data, key=lambda item: item.index)]


# (model, --ctx-size, --parallel, --flash-attn): contexts from 256 to the training context (and one beyond
# it), 1 to 4 slots, slot counts that divide the micro-batch and that do not (mean pooling then needs a
# smaller one), flash attention on, off and auto.
MEASURED = [
    ("bge", 256, 1, "on"),
    ("bge", 512, 2, "off"),
    ("bge", 1024, 4, "auto"),
    ("minilm", 512, 3, "auto"),
    ("minilm", 256, 2, "off"),
    ("nomic", 2048, 1, "off"),
    ("nomic", 1024, 3, "on"),
    ("nomic", 512, 4, "auto"),
    ("qwen3emb", 256, 1, "on"),
    ("qwen3emb", 4096, 4, "off"),
    ("qwen3emb", 2048, 3, "auto"),
    ("llama", 4096, 3, "auto"),
    ("llama", 1024, 2, "off"),
]


@pytest.mark.parametrize(("name", "ctx", "slots", "fa"), MEASURED)
async def test_embedding_estimates_are_within_2_percent_of_the_log(
    llama_server_binary, models, tmp_path, name, ctx, slots, fa
):
    path, shape = models[name]
    result = estimate(
        shape,
        aggregate_context=ctx,
        slots=slots,
        cache_type="f16",
        flash_attn=fa,
        devices=[synthetic_cpu(10**6)],
        embeddings=True,
    )
    assert result.pooling == (shape.pooling if shape.pooling != "none" else "mean")
    assert result.pooling is not None and result.ubatch_size is not None
    spec = LaunchSpec(
        model=path,
        alias="embed",
        ctx_size=ctx,
        slots=slots,
        flash_attn=fa,
        gpu_layers=0,
        threads=1,
        embeddings=True,
        pooling=result.pooling,
        ubatch_size=result.ubatch_size,
    )
    log = tmp_path / "server.log"
    async with running(llama_server_binary, spec, log) as server:
        vectors = await embed(server.endpoint, ["hello world", "the model server answers"])
    assert len(vectors) == 2 and all(len(v) == shape.n_embd for v in vectors)
    assert vectors[0] != vectors[1]

    text = log.read_text()
    facts = parse_server_log(text)
    (device,) = result.devices
    assert_close(device.compute_mib, facts.compute_mib["CPU"], "compute")
    assert_close(device.model_mib, facts.model_mib["CPU_Mapped"], "weights")
    (output,) = [float(m[2]) for m in _OUTPUT_RE.finditer(text) if m[1] == "CPU"]
    assert_close(device.output_at_start_mib, output, "output buffer")
    # An encoder has no K/V cache at all; a decoder's is exact.
    assert_close(device.context_mib, facts.kv_mib or 0.0, "K/V")
    assert (facts.kv_mib is None) == (shape.memory == "none")
    params = GraphParams(
        aggregate_context=ctx,
        slots=slots,
        cache_type="f16",
        flash_attn=result.flash_attn,
        n_ubatch=result.ubatch_size,
        embeddings=True,
    )
    (nodes,) = [int(n) for n in _NODES_RE.findall(text)]
    assert len(build_graph(shape, params).nodes) == nodes


async def test_an_encoder_accepts_inputs_as_long_as_its_slot_context(llama_server_binary, models, tmp_path):
    # nomic's training context (2048) is beyond llama-server's default micro-batch (512), which an encoder
    # must hold each input in whole: the plan launches it with a micro-batch of the slot context.
    path, shape = models["nomic"]
    p = plan(
        shape,
        [synthetic_cpu(10**4)],
        CustomPolicy(fit_target_mib=512, context_per_slot=2048, slots=1, cache_type="f16"),
        estimator=PythonEstimator(embeddings=True),
    )
    spec = launch_spec_for(p, model_path=path, alias="embed", threads=1)
    assert spec.embeddings and spec.pooling == "mean" and spec.ubatch_size == 2048
    async with running(llama_server_binary, spec, tmp_path / "server.log") as server:
        (vector,) = await embed(server.endpoint, [" ".join(["hello"] * 1900)])
    assert len(vector) == shape.n_embd


@pytest.mark.parametrize("name", ["bge", "qwen3emb", "llama"])
async def test_automatic_embedding_plans_launch_with_the_models_own_pooling(
    llama_server_binary, models, tmp_path, name
):
    path, shape = models[name]
    p = plan(shape, [synthetic_cpu(1024)], AutoPolicy(fit_target_mib=256), estimator=PythonEstimator(embeddings=True))
    # An encoder is always planned and launched for embeddings, whatever the caller says.
    spec = launch_spec_for(p, model_path=path, alias="embed", threads=1, embeddings=shape.memory != "none")
    own = {"bge": "cls", "qwen3emb": "last", "llama": "mean"}[name]
    argv = replace(spec, port=1).argv(Path("llama-server"))
    assert argv[argv.index("--pooling") + 1] == own and "--embeddings" in argv
    assert argv[argv.index("--ubatch-size") + 1] == argv[argv.index("--batch-size") + 1] == str(p.estimate.ubatch_size)
    log = tmp_path / "server.log"
    async with running(llama_server_binary, spec, log) as server:
        vectors = await embed(server.endpoint, ["hello", "world"])
        # Every planned value is read back; an encoder has no cache to match, a decoder its K/V cache.
        record = await verify_runtime(
            p, endpoint=server.endpoint, log_path=log, alias="embed", devices_after=read_devices(allow_cpu=True)
        )
    assert record.unverified == [] and len(record.memory) == (0 if shape.memory == "none" else 1)
    assert [len(v) for v in vectors] == [shape.n_embd] * 2
    facts = parse_server_log(log.read_text())
    (device,) = p.estimate.devices
    assert_close(device.compute_mib, facts.compute_mib["CPU"], "compute")
    assert facts.n_slots == p.slots and facts.n_ctx == p.aggregate_context
    assert facts.n_ctx_slot == p.slot_context_limit

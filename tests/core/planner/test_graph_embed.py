from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from qiip_core.engines.llamacpp import launch_spec_for
from qiip_core.planner import CustomPolicy, ModelShape, PythonEstimator, estimate, plan
from qiip_core.planner._compute import build_graph, is_modelled
from qiip_core.planner._embeddings import embeddings_ubatch, output_buffer_bytes, output_rows
from qiip_core.planner._graph import GraphParams, reserve_batch
from qiip_core.planner._types import MIB

from .conftest import cpu

# The embedding test models of tests/core/planner/test_family_embed.py: (architecture, blocks, width, heads,
# K/V heads, training context, vocabulary, FFN width, pooling, fused QKV).
SHAPES: dict[str, tuple[str, int, int, int, int, int, int, int, str, bool]] = {
    "bge": ("bert", 2, 128, 4, 4, 512, 8000, 512, "cls", False),
    "minilm": ("bert", 3, 96, 6, 6, 512, 800, 384, "mean", True),
    "nomic": ("nomic-bert", 2, 128, 4, 4, 2048, 1000, 384, "mean", True),
    "qwen3emb": ("qwen3", 2, 128, 4, 2, 4096, 16000, 384, "last", False),
    "llama": ("llama", 2, 128, 4, 2, 4096, 1000, 384, "none", False),
}

# What llama-server (llama.cpp as vendored by llama-cpp-python 0.3.36, CPU build) logged with --embeddings and
# the pooling and micro-batch the estimate asks for: `sched_reserve: CPU compute buffer size` in MiB and
# `sched_reserve: graph: nodes`, for --ctx-size, --parallel and --flash-attn.
LOGGED = [
    ("bge", 256, 1, "on", 1.00, 75),
    ("bge", 512, 2, "off", 6.51, 81),
    ("bge", 1024, 4, "auto", 2.26, 75),
    ("minilm", 512, 3, "auto", 1.82, 97),
    ("minilm", 256, 2, "off", 2.32, 106),
    ("minilm", 512, 4, "on", 1.83, 97),
    ("nomic", 2048, 1, "off", 88.03, 71),
    ("nomic", 1024, 3, "on", 8.01, 65),
    ("nomic", 512, 4, "auto", 3.51, 65),
    ("nomic", 2048, 4, "auto", 20.05, 65),
    ("qwen3emb", 256, 1, "on", 16.01, 77),
    ("qwen3emb", 4096, 4, "off", 41.51, 87),
    ("qwen3emb", 2048, 3, "auto", 33.52, 77),
    ("qwen3emb", 8192, 2, "on", 39.51, 77),
    ("llama", 4096, 3, "auto", 7.24, 71),
    ("llama", 4096, 4, "auto", 7.27, 71),
    ("llama", 1024, 2, "off", 11.51, 81),
]


def named(name: str) -> ModelShape:
    arch, layers, width, heads, kv_heads, train, vocab, ff, pooling, fused = SHAPES[name]
    encoder = arch in ("bert", "nomic-bert")
    return ModelShape(
        architecture=arch,
        n_layers=layers,
        n_embd=width,
        n_head=heads,
        n_head_kv=kv_heads,
        head_dim_k=width // heads,
        head_dim_v=width // heads,
        n_ff=ff,
        n_ctx_train=train,
        n_vocab=vocab,
        weights_bytes=4 << 20,
        memory="none" if encoder else "kv",
        causal=not encoder,
        pooling=pooling,  # type: ignore[arg-type]
        fused_qkv=fused,
        tied_output=arch == "qwen3",
    )


def embeddings_estimate(shape: ModelShape, ctx: int, slots: int, fa: Any, **kwargs: Any) -> Any:
    return estimate(
        shape, aggregate_context=ctx, slots=slots, cache_type="f16", flash_attn=fa, devices=[cpu(10**6)], **kwargs
    )


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "compute_mib", "nodes"), LOGGED)
def test_embedding_graphs_are_what_llama_server_reserved(name, ctx, slots, fa, compute_mib, nodes):
    shape = named(name)
    assert is_modelled(shape)
    result = embeddings_estimate(shape, ctx, slots, fa, embeddings=True)
    assert round(result.devices[0].compute_mib, 2) == compute_mib
    params = GraphParams(
        aggregate_context=ctx,
        slots=slots,
        cache_type="f16",
        flash_attn=result.flash_attn,
        n_ubatch=result.ubatch_size,
        embeddings=True,
    )
    assert len(build_graph(shape, params).nodes) == nodes


def test_an_encoder_has_no_cache_no_logits_and_is_always_served_for_embeddings():
    shape = named("bge")
    result = embeddings_estimate(shape, 1024, 4, "auto")  # embeddings not asked for: an encoder serves nothing else
    (device,) = result.devices
    assert result.caches == () and device.context_mib == 0
    assert result.pooling == "cls" and result.ubatch_size == 512
    graph = build_graph(shape, GraphParams(aggregate_context=1024, slots=4, cache_type="f16", flash_attn=True))
    names = {t.name for t in graph.nodes} | {t.name for t in graph.leafs}
    assert "result_output" not in names and "output.weight" not in names and not any("cache_" in n for n in names)
    # The mask covers the micro-batch itself, both ways: tokens × tokens.
    (mask,) = [t for t in graph.leafs if t.name == "self_kq_mask"]
    assert mask.ne[:2] == (512, 512) and mask.dtype == "f16"


@pytest.mark.parametrize(
    ("pooling", "leaf", "leaf_shape", "last_op"),
    [
        ("mean", "inp_mean", (512, 4), "MUL_MAT"),
        ("cls", "inp_cls", (4, 1), "GET_ROWS"),
        ("last", "inp_cls", (4, 1), "GET_ROWS"),
    ],
)
def test_the_pooling_stage_follows_the_pooling_type(pooling, leaf, leaf_shape, last_op):
    shape = replace(named("qwen3emb"), pooling=pooling)
    graph = build_graph(
        shape, GraphParams(aggregate_context=4096, slots=4, cache_type="f16", flash_attn=True, embeddings=True)
    )
    (inp,) = [t for t in graph.leafs if t.name == leaf]
    assert inp.ne[:2] == leaf_shape
    pooled = graph.nodes[-1]
    assert pooled.name == "result_embd_pooled" and pooled.op == last_op and pooled.is_output
    assert pooled.ne[:2] == (shape.n_embd, 4)
    # A decoder still computes the logits of every output row before pooling.
    (logits,) = [t for t in graph.nodes if t.name == "result_output"]
    assert logits.ne[:2] == (shape.n_vocab, 512)


def test_qwen3_is_llama_with_an_rms_norm_of_every_q_and_k_head():
    qwen3 = replace(named("qwen3emb"), pooling="none")
    llama = replace(qwen3, architecture="llama")
    params = GraphParams(aggregate_context=4096, slots=1, cache_type="f16", flash_attn=True)
    extra = len(build_graph(qwen3, params).nodes) - len(build_graph(llama, params).nodes)
    assert extra == qwen3.n_layers * 2 * 2  # rms_norm and the weight's mul, for Q and for K
    norms = [t for t in build_graph(qwen3, params).nodes if t.name.startswith("norm-Qcur_normed")]
    assert norms[0].ne[:3] == (32, 4, 512)


@pytest.mark.parametrize(
    ("name", "ctx", "slots", "expected"),
    [
        # An encoder encodes each input whole: the micro-batch is the slot context.
        ("bge", 4096, 8, 512),
        ("bge", 256, 1, 256),
        ("nomic", 8192, 2, 2048),
        ("nomic", 1024, 1, 1024),
        # Mean pooling: a multiple of the slots, or llama-server aborts reserving the graph.
        ("nomic", 1024, 3, 1023),
        ("minilm", 512, 3, 510),
        ("minilm", 1024, 600, 600),
        ("llama", 4096, 3, 510),
        ("llama", 4096, 4, 512),
        ("llama", 256, 3, 255),
        # Last-token pooling splits inputs like generation: llama-server's default.
        ("qwen3emb", 4096, 3, 512),
        ("qwen3emb", 256, 3, 256),
    ],
)
def test_the_embeddings_micro_batch(name, ctx, slots, expected):
    ubatch = embeddings_ubatch(named(name), aggregate_context=ctx, slots=slots)
    assert ubatch == expected
    # The reserved micro-batch is then a whole number of slots' tokens whenever the outputs must cover it.
    params = GraphParams(
        aggregate_context=ctx, slots=slots, cache_type="f16", flash_attn=True, n_ubatch=ubatch, embeddings=True
    )
    tokens, outputs = reserve_batch(params)
    if named(name).embeddings_pooling == "mean":
        assert tokens == outputs


def test_the_output_buffer_at_start_and_at_its_largest():
    shape = named("qwen3emb")
    result = embeddings_estimate(shape, 4096, 4, "on", embeddings=True)
    (device,) = result.devices
    row = (shape.n_vocab + shape.n_embd) * 4
    assert device.output_at_start_mib == 4 * row / MIB  # what `output buffer size` logs: a row per slot
    assert device.output_mib == 512 * row / MIB  # every token of a batch once embeddings are served
    assert device.total_mib == device.model_mib + device.context_mib + device.compute_mib + device.output_mib
    generative = embeddings_estimate(shape, 4096, 4, "on").devices[0]
    assert generative.output_mib == generative.output_at_start_mib == 4 * shape.n_vocab * 4 / MIB
    # An encoder computes no logits, but llama.cpp reserves their rows all the same.
    bge = named("bge")
    assert output_buffer_bytes(bge, rows=1, embeddings=True) == (8000 + 128) * 4
    assert output_rows(slots=600, ubatch=512, embeddings=True) == 600
    assert output_rows(slots=4, ubatch=512, embeddings=False) == 4


def test_launch_spec_for_launches_what_the_estimate_assumed(tmp_path):
    bge, llama = named("bge"), named("llama")
    policy = CustomPolicy(fit_target_mib=64, context_per_slot=512, slots=3, cache_type="f16")
    devices = [cpu(4096)]
    encoder = plan(bge, devices, policy, estimator=PythonEstimator())
    spec = launch_spec_for(encoder, model_path=tmp_path / "m.gguf", alias="m")
    assert (spec.embeddings, spec.pooling, spec.ubatch_size) == (True, "cls", 512)
    embedder = plan(llama, devices, policy, estimator=PythonEstimator(embeddings=True))
    spec = launch_spec_for(embedder, model_path=tmp_path / "m.gguf", alias="m", embeddings=True)
    assert (spec.embeddings, spec.pooling, spec.ubatch_size) == (True, "mean", 510)
    generator = plan(llama, devices, policy, estimator=PythonEstimator())
    spec = launch_spec_for(generator, model_path=Path("m.gguf"), alias="m")
    assert (spec.embeddings, spec.ubatch_size) == (False, None)
    # Asked for embeddings without an embeddings plan: the old launch, mean pooling and default batches.
    spec = launch_spec_for(generator, model_path=Path("m.gguf"), alias="m", embeddings=True)
    assert (spec.embeddings, spec.pooling, spec.ubatch_size) == (True, "mean", None)

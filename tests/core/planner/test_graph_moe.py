"""The mixture-of-experts block and graphs, without a server: node order, shapes, registration, and compute
buffers pinned to what llama-server 0.3.36 logged for the same models (tests/core/planner/test_family_moe.py
measures them live)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from qiip_core.engines.llamacpp import make_test_gguf, read_gguf_metadata
from qiip_core.planner import ModelShape, estimate
from qiip_core.planner._compute import EXPERT_GRAPHS, GRAPH_BUILDERS, build_graph, is_modelled
from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import Builder, Graph, GraphParams, Tensor, ne4
from qiip_core.planner._graph_moe import expert_ff, moe_ffn
from qiip_core.planner._shape import WeightMatrix
from tests.core.planner.conftest import gpu, shape as llama_shape


def moe_shape(
    architecture: str = "qwen3moe",
    *,
    n_layers: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 512,
    n_vocab: int = 1000,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_expert: int = 256,
    n_ff_shared_expert: int = 0,
) -> ModelShape:
    head = n_embd // n_head
    return ModelShape(
        architecture=architecture,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head,
        head_dim_v=head,
        n_ff=n_ff,
        n_ctx_train=4096,
        n_vocab=n_vocab,
        weights_bytes=10 << 20,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff_expert=n_ff_expert,
        n_ff_shared_expert=n_ff_shared_expert,
    )


def block(shape: ModelShape, *, tokens: int = 512, norm_w: bool = True) -> tuple[Graph, Tensor]:
    """One expert block alone, over a `[n_embd, tokens]` input."""
    b, g = Builder(0), Graph()
    cur = b.leaf("ffn_norm", "f32", ne4(shape.n_embd, tokens))
    out = moe_ffn(b, g, shape, 0, cur, norm_w=norm_w)
    g.expand(out)
    return g, out


def params(ctx: int, slots: int, *, fa: bool, cache: str = "f16") -> GraphParams:
    return GraphParams(aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=fa)  # type: ignore[arg-type]


def test_one_block_is_built_in_llama_cpp_order():
    g, out = block(moe_shape(n_expert_used=3))
    assert [n.op for n in g.nodes] == [
        # router: logits, probabilities, (sources in order) their [1, n_expert] rows and the top-k view of a
        # full argsort, the chosen weights, renormalised
        "MUL_MAT",
        "SOFT_MAX",
        "RESHAPE",
        "ARGSORT",
        "VIEW",
        "GET_ROWS",
        "RESHAPE",
        "SUM_ROWS",
        "CLAMP",
        "DIV",
        "RESHAPE",
        # experts: up, gate, swiglu, down, weighted
        "RESHAPE",
        "MUL_MAT_ID",
        "MUL_MAT_ID",
        "GLU",
        "MUL_MAT_ID",
        "MUL",
        # one view per used expert, then the sum
        "VIEW",
        "VIEW",
        "VIEW",
        "ADD",
        "ADD",
    ]
    assert g.nodes[-1] is out and out.ne == (128, 512, 1, 1)


def test_mul_mat_id_shapes_follow_ggml():
    shape = moe_shape(n_embd=128, n_expert=16, n_expert_used=4, n_ff_expert=96)
    g, _ = block(shape, tokens=64)
    up, gate, down = (n for n in g.nodes if n.op == "MUL_MAT_ID")
    # [as.ne[1], ids.ne[0], b.ne[2]]: rows of one expert, experts per token, tokens
    assert up.ne == gate.ne == (96, 4, 64, 1)
    assert down.ne == (128, 4, 64, 1)
    experts, x, ids = up.src
    assert experts.ne == (128, 96, 16, 1) and experts.external
    assert x.ne == (128, 1, 64, 1) and x.op == "RESHAPE"
    assert ids.ne == (4, 64, 1, 1) and ids.dtype == "i32" and ids.op == "VIEW"
    assert ids.view_src is not None and ids.view_src.op == "ARGSORT" and ids.view_src.ne == (16, 64, 1, 1)
    weights = next(n for n in g.nodes if n.op == "GET_ROWS")
    assert weights.ne == (1, 4, 64, 1)


def test_one_used_expert_is_a_cont_and_unnormalised_weights_skip_the_sum():
    g, out = block(moe_shape(n_expert_used=1), norm_w=False)
    ops = [n.op for n in g.nodes] + [out.op]
    assert out.op == "CONT" and "ADD" not in ops
    assert not {"SUM_ROWS", "CLAMP", "DIV"} & set(ops)


def test_expert_width_comes_from_the_tensor_when_known():
    shape = moe_shape(n_ff_expert=0, n_ff=512)
    assert expert_ff(shape) == 512
    assert expert_ff(replace(shape, n_ff_expert=192)) == 192
    with_tensor = replace(shape, weight_matrices=(WeightMatrix("blk.1.ffn_up_exps.weight", "F16", 160, 1),))
    assert expert_ff(with_tensor, 1) == 160 and expert_ff(with_tensor, 0) == 512


def test_mixtral_without_gate_experts_uses_silu():
    shape = replace(
        moe_shape("llama"),
        weight_matrices=(
            WeightMatrix("blk.0.ffn_up_exps.weight", "F16", 256, 1),
            WeightMatrix("blk.0.ffn_down_exps.weight", "F16", 128, 1),
        ),
    )
    g, _ = block(shape)
    ops = [n.op for n in g.nodes]
    assert ops.count("MUL_MAT_ID") == 2 and "GLU" not in ops and "UNARY" in ops


def test_expert_architectures_are_registered_and_modelled():
    assert {"llama", "qwen2moe", "qwen3moe"} <= EXPERT_GRAPHS
    assert {"qwen2moe", "qwen3moe"} <= set(GRAPH_BUILDERS)
    assert is_modelled(moe_shape("llama")) and is_modelled(moe_shape("qwen3moe")) and is_modelled(moe_shape("qwen2moe"))
    assert not is_modelled(moe_shape("deepseek2"))


def test_dense_llama_has_no_experts_and_mixtral_has_them_in_every_block():
    dense = build_graph(llama_shape(), params(4096, 1, fa=True))
    assert "MUL_MAT_ID" not in {n.op for n in dense.nodes}
    mixtral = build_graph(moe_shape("llama", n_layers=3), params(4096, 1, fa=True))
    assert sum(n.op == "MUL_MAT_ID" for n in mixtral.nodes) == 3 * 3
    assert not any(n.name.startswith("ffn_up-") for n in mixtral.nodes)


def test_qwen3moe_norms_q_and_k_and_qwen2moe_adds_biases_and_a_shared_expert():
    q3 = build_graph(moe_shape("qwen3moe"), params(2048, 1, fa=True))
    q2 = build_graph(moe_shape("qwen2moe", n_ff_shared_expert=384), params(2048, 1, fa=True))
    names3, names2 = {n.name for n in q3.nodes}, {n.name for n in q2.nodes}
    assert {"Qcur_normed-0", "Kcur_normed-1"} <= names3 and "ffn_shexp_out-0" not in names3
    assert {"ffn_shexp_out-0", "ffn_out-1"} <= names2 and "Qcur_normed-0" not in names2
    shared_up = next(n for n in q2.nodes if n.name == "ffn_up_shexp-0")
    assert shared_up.ne == (384, 512, 1, 1)
    assert not any(n.op == "SUM_ROWS" for n in q2.nodes)  # qwen2moe keeps the weights as the softmax gave them


def test_a_model_without_experts_is_refused_by_the_qwen_builder():
    with pytest.raises(ValueError, match="needs experts"):
        GRAPH_BUILDERS["qwen3moe"](moe_shape(n_expert=0, n_expert_used=0), params(512, 1, fa=True))


# (shape, ctx, slots, flash attention, nodes logged, compute MiB logged) by llama-server 0.3.36 on the same models.
LOGGED = [
    (moe_shape(n_embd=256, n_ff=1024, n_expert=32, n_expert_used=8, n_ff_expert=512), 512, 1, True, 132, 26.51),
    (moe_shape(n_expert=4, n_expert_used=1, n_ff_expert=512), 512, 1, True, 106, 4.51),
    (moe_shape("llama", n_ff=256, n_ff_expert=256), 4096, 3, False, 110, 41.59),
    (moe_shape("qwen2moe", n_ff_expert=256), 2048, 3, False, 124, 21.84),
]


@pytest.mark.parametrize(("shape", "ctx", "slots", "fa", "nodes", "compute_mib"), LOGGED)
def test_compute_buffers_match_what_llama_server_logged(shape, ctx, slots, fa, nodes, compute_mib):
    graph = build_graph(shape, params(ctx, slots, fa=fa))
    assert len(graph.nodes) == nodes
    assert round(compute_buffer_bytes(graph)[0] / 2**20, 2) == compute_mib


def test_on_gpus_each_block_carries_its_experts(tmp_path):
    options = {"n_expert": 8, "n_expert_used": 2, "n_ff_expert": 128}
    [path] = make_test_gguf(tmp_path / "m.gguf", architecture="qwen3moe", n_layers=4, options=options)
    shape = ModelShape.from_metadata(read_gguf_metadata(path))
    result = estimate(
        shape,
        aggregate_context=4096,
        slots=2,
        cache_type="f16",
        flash_attn="auto",
        devices=[gpu(0, 20000), gpu(1, 20000)],
    )
    assert result.host is not None
    placed = sum(d.model_mib for d in result.devices) + result.host.model_mib
    assert placed * 2**20 == pytest.approx(shape.weights_bytes)
    experts = 3 * 8 * 128 * 64 * 2
    assert all(b > experts for b in shape.block_bytes)
    assert result.devices[0].model_mib * 2**20 >= 2 * experts and all(d.compute_mib > 0 for d in result.devices)

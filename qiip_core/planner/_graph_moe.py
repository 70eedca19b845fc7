"""Mixture-of-experts feed-forward blocks (`build_moe_ffn` in `src/llama-graph.cpp`), and the graphs of the
decoders made of them: `qwen3moe` (`src/models/qwen3moe.cpp`), `qwen2moe` (`src/models/qwen2moe.cpp`), and,
through a hook in `_graph_llama.py`, Mixtral-style `llama` models with experts.

```
cur [n_embd, tokens]
 ├─ mul_mat(ffn_gate_inp) = logits [n_expert, tokens] ─ soft_max = probs
 │   argsort(probs, descending) [n_expert, tokens] ─ view: the first n_expert_used = selected (i32)
 │   get_rows(reshape(probs) [1, n_expert, tokens], selected) = weights [1, n_expert_used, tokens]
 │   [normalised: reshape ─ sum_rows ─ clamp ─ div ─ reshape]                  (expanded here, first)
 └─ reshape [n_embd, 1, tokens]
     up   = mul_mat_id(ffn_up_exps,   cur, selected) [n_ff_exp, n_expert_used, tokens]
     gate = mul_mat_id(ffn_gate_exps, cur, selected) ─ swiglu(gate, up)
     down = mul_mat_id(ffn_down_exps, ·,   selected) [n_embd, n_expert_used, tokens] ─ mul(weights)
     view per used expert [n_embd, tokens] ─ add, add, … = moe_out (a cont when only one expert is used)
qwen2moe adds a shared expert: a dense SwiGLU feed-forward times sigmoid(ffn_gate_inp_shexp · cur).
```

The expert weights are 3-D (`[n_in, n_out, n_expert]`); the graph multiplies each token by the slices its
router picked (`ggml_mul_mat_id`, result `[as.ne[1], ids.ne[0], b.ne[2]]`). The intermediates are
`n_expert_used` times as large as a dense feed-forward of the expert width would need, which is what the
compute buffer grows with. In-place reuse follows ggml: the soft_max takes over the logits, the clamp the sum,
the weighting multiplication the down projection, every add after the first the running sum.

The router settings are llama.cpp's, per architecture: softmax gating everywhere here; the chosen weights are
renormalised to sum to one for llama and qwen3moe, and kept as they are for qwen2moe.
"""

from __future__ import annotations

from qiip_core.planner._graph import (
    Builder,
    Graph,
    GraphParams,
    Tensor,
    attention,
    embed_tokens,
    kv_inputs,
    layer_devices,
    ne4,
    output_layer,
    project_qkv,
    reserve_batch,
)
from qiip_core.planner._shape import ModelShape

__all__ = ["build_qwen_moe_graph", "expert_ff", "moe_ffn", "mul_mat_id"]

NORMALISED_WEIGHTS: dict[str, bool] = {"llama": True, "qwen3moe": True, "qwen2moe": False}
"""Whether `build_moe_ffn` renormalises the chosen experts' weights (`norm_w`), per architecture."""


def mul_mat_id(b: Builder, name: str, experts: Tensor, cur: Tensor, ids: Tensor) -> Tensor:
    """`ggml_mul_mat_id`: each token's row times the expert matrices `ids` selects.

    Args:
        b: the builder.
        name: the result's name.
        experts: `[n_in, n_out, n_expert]` stacked weights.
        cur: `[n_in, 1 or n_used, tokens]` inputs.
        ids: `[n_used, tokens]` selected experts (i32).

    Returns:
        `[n_out, n_used, tokens]`, F32.
    """
    return b.new(name, "MUL_MAT_ID", "f32", ne4(experts.ne[1], ids.ne[0], cur.ne[2]), experts, cur, ids)


def _get_rows_3d(b: Builder, name: str, a: Tensor, rows: Tensor) -> Tensor:
    # ggml_get_rows with a 2-D index: [a.ne0, rows.ne0, rows.ne1, rows.ne2].
    return b.new(name, "GET_ROWS", "f32", ne4(a.ne[0], rows.ne[0], rows.ne[1], rows.ne[2]), a, rows)


def _rows(shape: ModelShape) -> dict[str, int]:
    return {m.name: m.rows for m in shape.weight_matrices}


def expert_ff(shape: ModelShape, il: int = 0, *, rows: dict[str, int] | None = None) -> int:
    """One expert's feed-forward width (`n_ff_exp`) in block `il`.

    The width of the block's `ffn_up_exps` tensor when the file's tensors are known: llama.cpp sizes the experts
    by rules that differ per architecture (Mixtral's from `feed_forward_length`, Qwen's from
    `expert_feed_forward_length`, else `n_ff / n_expert_used`), and the tensor is what they produced. Otherwise
    `n_ff_expert`, else `n_ff`.

    Args:
        shape: the model.
        il: the block.
        rows: `{tensor name: rows}` of `shape.weight_matrices`, when the caller already has it.
    """
    found = (rows if rows is not None else _rows(shape)).get(f"blk.{il}.ffn_up_exps.weight")
    return found or shape.n_ff_expert or shape.n_ff


def moe_ffn(
    b: Builder,
    g: Graph,
    shape: ModelShape,
    il: int,
    cur: Tensor,
    *,
    norm_w: bool,
    rows: dict[str, int] | None = None,
) -> Tensor:
    """`build_moe_ffn` with softmax gating, separate gate and up experts and SwiGLU, as llama.cpp builds it.

    Args:
        b: the builder, on the layer's device.
        g: the graph; the weights and the expert outputs are expanded here, in llama.cpp's order.
        shape: the model (`n_expert`, `n_expert_used`, `n_ff_expert`).
        il: the block.
        cur: the normalised input, `[n_embd, tokens]`.
        norm_w: renormalise the chosen experts' weights to sum to one.
        rows: `{tensor name: rows}` of the model's weights (`expert_ff`), computed when not given.

    Returns:
        `[n_embd, tokens]`: the weighted sum of the chosen experts' outputs.
    """
    e, n_tok, blk = shape.n_embd, cur.ne[1], f"blk.{il}"
    rows = rows if rows is not None else _rows(shape)
    n_expert, n_used, ff = shape.n_expert, shape.n_expert_used, expert_ff(shape, il, rows=rows)
    # Mixtral's gate experts are optional (`TENSOR_NOT_REQUIRED`): without them the up projection goes through silu.
    has_gate = not rows or f"{blk}.ffn_gate_exps.weight" in rows
    logits = b.mul_mat(f"ffn_moe_logits-{il}", b.weight(f"{blk}.ffn_gate_inp", e, n_expert), cur)
    probs = b.same(f"ffn_moe_probs-{il}", "SOFT_MAX", logits)
    # ggml_argsort_top_k: a full descending argsort, then a view of its first n_used columns.
    order = b.new(f"ffn_moe_argsort-{il}", "ARGSORT", "i32", probs.ne, probs)
    selected = b.view(order, ne4(n_used, n_tok), order.nb)
    weights = _get_rows_3d(b, f"ffn_moe_weights-{il}", b.reshape(probs, ne4(1, n_expert, n_tok)), selected)
    if norm_w:
        flat = b.reshape(weights, ne4(n_used, n_tok))
        total = b.new(f"ffn_moe_weights_sum-{il}", "SUM_ROWS", "f32", ne4(1, n_tok), flat)
        total = b.same(f"ffn_moe_weights_sum_clamped-{il}", "CLAMP", total)
        weights = b.reshape(b.same(f"ffn_moe_weights_norm-{il}", "DIV", flat, total), ne4(1, n_used, n_tok))
    g.expand(weights)

    x = b.reshape(cur, ne4(e, 1, n_tok))
    up = mul_mat_id(b, f"ffn_moe_up-{il}", b.weight(f"{blk}.ffn_up_exps", e, ff, n_expert), x, selected)
    if has_gate:
        gate = mul_mat_id(b, f"ffn_moe_gate-{il}", b.weight(f"{blk}.ffn_gate_exps", e, ff, n_expert), x, selected)
        act = b.same(f"ffn_moe_swiglu-{il}", "GLU", gate, up)
    else:
        act = b.same(f"ffn_moe_silu-{il}", "UNARY", up)
    down = mul_mat_id(b, f"ffn_moe_down-{il}", b.weight(f"{blk}.ffn_down_exps", ff, e, n_expert), act, selected)
    experts = b.same(f"ffn_moe_weighted-{il}", "MUL", down, weights)
    g.expand(experts)

    # One [n_embd, tokens] view per used expert (rows n_used apart), all expanded before the adds.
    strides = (experts.nb[0], experts.nb[2], experts.nb[2] * n_tok, experts.nb[2] * n_tok)
    views = [b.view(experts, ne4(e, n_tok), strides) for _ in range(n_used)]
    for view in views:
        g.expand(view)
    out = views[0]
    for view in views[1:]:
        out = b.new(f"ffn_moe_out-{il}", "ADD", "f32", ne4(e, n_tok), out, view)
        g.expand(out)
    if n_used == 1:
        out = b.new(f"ffn_moe_out-{il}", "CONT", "f32", ne4(e, n_tok), out)
    return out


def _shared_expert(b: Builder, shape: ModelShape, il: int, cur: Tensor, rows: dict[str, int]) -> Tensor:
    """qwen2moe's shared expert: a dense SwiGLU feed-forward scaled by `sigmoid(ffn_gate_inp_shexp · cur)`.

    Its width is the `ffn_up_shexp` tensor's, else `expert_shared_feed_forward_length`, else `n_ff` (llama.cpp's
    fallback in `llama_model_qwen2moe::load_arch_tensors`).
    """
    e, blk = shape.n_embd, f"blk.{il}"
    ff = rows.get(f"{blk}.ffn_up_shexp.weight") or shape.n_ff_shared_expert or shape.n_ff
    gate_inp = b.mul_mat(f"ffn_shexp_gate_inp-{il}", b.weight(f"{blk}.ffn_gate_inp_shexp", e), cur)
    # sigmoid(x) = silu(x) / x
    gate = b.same(f"ffn_shexp_gate-{il}", "DIV", b.same(f"ffn_shexp_silu-{il}", "UNARY", gate_inp), gate_inp)
    up = b.mul_mat(f"ffn_up_shexp-{il}", b.weight(f"{blk}.ffn_up_shexp", e, ff), cur)
    gated = b.mul_mat(f"ffn_gate_shexp-{il}", b.weight(f"{blk}.ffn_gate_shexp", e, ff), cur)
    act = b.same(f"ffn_shexp_act-{il}", "GLU", gated, up)
    ffn = b.mul_mat(f"ffn_shexp-{il}", b.weight(f"{blk}.ffn_down_shexp", ff, e), act)
    return b.same(f"ffn_shexp_out-{il}", "MUL", ffn, gate)


def build_qwen_moe_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of a qwen3moe or qwen2moe model.

    qwen3moe normalises Q and K per head (RMS) before RoPE; qwen2moe adds Q/K/V biases and a shared expert.
    Both route every block's feed-forward through `moe_ffn`.

    Args:
        shape: the model (`qwen3moe` or `qwen2moe`, with `n_expert` > 0).
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output, or the model has
            no experts.
    """
    devices = layer_devices(shape, params)
    if shape.n_expert < 1:
        raise ValueError(f"a {shape.architecture} model needs experts (expert_count > 0).")
    qwen3 = shape.architecture == "qwen3moe"
    n_tok, n_out = reserve_batch(params)
    e, n_head, dv = shape.n_embd, shape.n_head, shape.head_dim_v
    rows = _rows(shape)
    g = Graph()
    b = Builder(params.host)

    inp = embed_tokens(b, g, shape, n_tok)
    inp_pos = b.leaf("inp_pos", "i32", ne4(n_tok))
    kv = kv_inputs(
        b,
        shape,
        layers=shape.attention_layers(),
        cells=params.aggregate_context,
        n_tok=n_tok,
        flash_attn=params.flash_attn,
        cache_type=params.cache_type,
    )
    out_ids = b.leaf("out_ids", "i32", ne4(n_out))

    for il in range(shape.n_layers):
        b.device = devices[il]
        blk = f"blk.{il}"
        residual = inp
        cur = b.norm(f"attn_norm-{il}", inp, f"{blk}.attn_norm")
        q, k, v = project_qkv(b, shape, il, cur, n_tok=n_tok, inp_pos=inp_pos, biases=not qwen3, qk_norm=qwen3)
        cur = attention(b, g, il=il, q=q, k=k, v=v, inp=kv, cache_type=params.cache_type, flash_attn=params.flash_attn)
        cur = b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", n_head * dv, e), cur)
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, out_ids)
            residual = b.get_rows("last_inp", residual, out_ids)
        ffn_inp = b.same(f"ffn_inp-{il}", "ADD", cur, residual)
        cur = b.norm(f"ffn_norm-{il}", ffn_inp, f"{blk}.ffn_norm")
        out = moe_ffn(b, g, shape, il, cur, norm_w=NORMALISED_WEIGHTS[shape.architecture], rows=rows)
        if not qwen3:
            out = b.same(f"ffn_out-{il}", "ADD", out, _shared_expert(b, shape, il, cur, rows))
        inp = b.same(f"l_out-{il}", "ADD", out, ffn_inp)

    output_layer(b, g, shape, params, inp, device=devices[-1])
    return g

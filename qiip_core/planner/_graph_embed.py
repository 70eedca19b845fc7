"""BERT-style encoders' graph (`src/models/bert.cpp`, which `nomic-bert` shares): no K/V cache, attention both
ways over the micro-batch, post-norm blocks, and pooling instead of logits.

```
get_rows(token_embd) + token_types[0] [+ get_rows(position_embd, inp_pos)]   (bert: absolute positions)
layer_norm · token_embd_norm (+ bias)
for each block:
  Q, K, V = mul_mat (+ bias), separate or one fused QKV viewed three ways   [nomic-bert: rope(Q), rope(K)]
  flash attention:  cast K and V to F16 ─ flash_attn_ext(Q, K, V, kq_mask [tokens, tokens])
  otherwise:        kq = mul_mat(K, Q) [tokens, tokens, n_head] ─ soft_max(kq, kq_mask) ─ cont(Vᵀ) ─ mul_mat ─ cont
  mul_mat(wo) (+ bias) + residual ─ layer_norm · attn_output_norm (+ bias)
  bert: up (+ bias) ─ gelu ─ down (+ bias)      nomic-bert: up, gate ─ swiglu ─ down
  + residual ─ layer_norm · layer_output_norm (+ bias)
pooling (`build_pooling`): mean, cls or last over the last block's output (no output norm, no logits)
```

Without a cache the keys and values are the micro-batch's own (`build_attn_inp_no_cache`): the mask is
`tokens × tokens`, and the attention scores without flash attention are `tokens × tokens × n_head` F32 — for a
long micro-batch the largest tensor, as the scores over the K/V cache are for a decoder.
"""

from __future__ import annotations

from qiip_core.planner._graph import (
    Builder,
    Graph,
    GraphParams,
    Tensor,
    embed_tokens,
    layer_devices,
    ne4,
    pooling_stage,
    reserve_batch,
)
from qiip_core.planner._shape import ModelShape, row_bytes

__all__ = ["attention_no_cache", "build_bert_graph"]


def attention_no_cache(
    b: Builder, g: Graph, *, il: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, flash_attn: bool
) -> Tensor:
    """Attend over the micro-batch itself (`build_attn` with `llm_graph_input_attn_no_cache`, `build_attn_mha`).

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        il: the block.
        q: `[head_dim, n_head, n_tok]` queries (a view of a fused QKV, or contiguous).
        k: `[head_dim, n_head_kv, n_tok]` keys.
        v: `[head_dim, n_head_kv, n_tok]` values.
        mask: `self_kq_mask`, `[n_tok, n_tok]`: F16 with flash attention, F32 without.
        flash_attn: flash attention runs.

    Returns:
        `[head_dim * n_head, n_tok]`, the attention output before the output projection.
    """
    for t in (q, k, v):
        g.expand(t)
    q4 = b.permute(b.view(q, q.ne, (q.nb[0], q.nb[1], q.nb[2], q.nb[2] * q.ne[2])), (0, 2, 1, 3))
    k4, v4 = b.permute(k, (0, 2, 1, 3)), b.permute(v, (0, 2, 1, 3))
    if flash_attn:
        # The kernel reads F16 keys and values; without a cache they are the F32 projections, cast here.
        k16 = b.new(f"Kcur-{il} (copy)", "CPY", "f16", k4.ne, k4)
        v16 = b.new(f"Vcur-{il} (copy)", "CPY", "f16", v4.ne, v4)
        att = b.new(f"fattn-{il}", "FLASH_ATTN_EXT", "f32", ne4(v16.ne[0], q4.ne[2], q4.ne[1]), q4, k16, v16, mask)
        cur = b.reshape(att, ne4(att.ne[0] * att.ne[1], att.ne[2]))
    else:
        kq = b.same(f"kq_soft_max-{il}", "SOFT_MAX", b.mul_mat(f"kq-{il}", k4, q4), mask)
        # V is not transposed in memory (no cache stores it so), so it is made contiguous transposed first.
        vt = b.view(v4, ne4(v4.ne[1], v4.ne[0], v4.ne[2]), (v4.nb[1], v4.nb[0], v4.nb[2], v4.nb[3]), "TRANSPOSE")
        v_cont = b.new(f"v_cont-{il}", "CONT", "f32", vt.ne, vt)
        kqv = b.permute(b.mul_mat(f"kqv-{il}", v_cont, kq), (0, 2, 1, 3))
        cur = b.new(f"kqv_out-{il}", "CONT", "f32", ne4(kqv.ne[0] * kqv.ne[1], kqv.ne[2]), kqv)
    g.expand(cur)
    return cur


def _qkv(b: Builder, shape: ModelShape, il: int, cur: Tensor, n_tok: int) -> tuple[Tensor, Tensor, Tensor]:
    """`build_qkv`: one fused projection viewed three ways, or three projections reshaped; biases as present."""
    e, hd, n_head, n_kv = shape.n_embd, shape.head_dim_k, shape.n_head, shape.n_head_kv
    blk, bias = f"blk.{il}", shape.architecture == "bert"
    if shape.fused_qkv:
        width = hd * (n_head + 2 * n_kv)
        qkv = b.mul_mat(f"wqkv-{il}", b.weight(f"{blk}.attn_qkv", e, width), cur)
        if bias:
            qkv = b.same(f"wqkv_b-{il}", "ADD", qkv, b.weight(f"{blk}.attn_qkv.bias", width))
        head, row = row_bytes("f32", hd), qkv.nb[1]

        def part(heads: int) -> Tensor:
            return b.view(qkv, ne4(hd, heads, n_tok), (qkv.nb[0], head, row, row * n_tok))

        return part(n_head), part(n_kv), part(n_kv)
    out = []
    for name, heads in (("q", n_head), ("k", n_kv), ("v", n_kv)):
        t = b.mul_mat(f"{name.upper()}cur-{il}", b.weight(f"{blk}.attn_{name}", e, hd * heads), cur)
        if bias:
            t = b.same(f"{name.upper()}cur-{il}", "ADD", t, b.weight(f"{blk}.attn_{name}.bias", hd * heads))
        out.append(b.reshape(t, ne4(hd, heads, n_tok)))
    return out[0], out[1], out[2]


def build_bert_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of a `bert` or `nomic-bert` encoder.

    Args:
        shape: the model.
        params: the server settings; `embeddings` adds the pooling stage (the server always runs an encoder
            with `--embeddings`).

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output.
    """
    devices = layer_devices(shape, params)
    nomic = shape.architecture == "nomic-bert"
    n_tok, n_out = reserve_batch(params)
    e, ff = shape.n_embd, shape.n_ff
    g = Graph()
    b = Builder(params.host)

    inp_pos = b.leaf("inp_pos", "i32", ne4(n_tok))
    inp = embed_tokens(b, g, shape, n_tok)
    # Every token is "Sentence A": row 0 of the token types, broadcast over the tokens.
    type_row0 = b.view(b.weight("token_types.weight", e, 2), ne4(e), (4, 4 * e, 4 * e, 4 * e))
    inp = b.same("inp_embd", "ADD", inp, type_row0)
    if not nomic:
        positions = b.get_rows("pos_embd", b.weight("position_embd.weight", e, shape.n_ctx_train), inp_pos)
        inp = b.same("inp_embd", "ADD", positions, inp)
    inp = b.norm("inp_norm", inp, "token_embd_norm", op="NORM", bias=True)
    mask = b.leaf("self_kq_mask", "f16" if params.flash_attn else "f32", ne4(n_tok, n_tok))
    out_ids = b.leaf("out_ids", "i32", ne4(n_out))

    for il in range(shape.n_layers):
        b.device = devices[il]
        blk = f"blk.{il}"
        q, k, v = _qkv(b, shape, il, inp, n_tok)
        if nomic:
            q = b.new(f"Qcur-{il}", "ROPE", "f32", q.ne, q, inp_pos)
            k = b.new(f"Kcur-{il}", "ROPE", "f32", k.ne, k, inp_pos)
        cur = attention_no_cache(b, g, il=il, q=q, k=k, v=v, mask=mask, flash_attn=params.flash_attn)
        cur = b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", e, e), cur)
        if not nomic:
            cur = b.same(f"attn_out-{il}", "ADD", cur, b.weight(f"{blk}.attn_output.bias", e))
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, out_ids)
            inp = b.get_rows("last_inp", inp, out_ids)
        cur = b.same(f"attn_res-{il}", "ADD", cur, inp)
        ffn_inp = b.norm(f"attn_out_norm-{il}", cur, f"{blk}.attn_output_norm", op="NORM", bias=True)
        up = b.mul_mat(f"ffn_up-{il}", b.weight(f"{blk}.ffn_up", e, ff), ffn_inp)
        if nomic:
            gate = b.mul_mat(f"ffn_gate-{il}", b.weight(f"{blk}.ffn_gate", e, ff), ffn_inp)
            act = b.same(f"ffn_swiglu-{il}", "GLU", gate, up)
            cur = b.mul_mat(f"ffn_out-{il}", b.weight(f"{blk}.ffn_down", ff, e), act)
        else:
            up = b.same(f"ffn_up_b-{il}", "ADD", up, b.weight(f"{blk}.ffn_up.bias", ff))
            act = b.same(f"ffn_gelu-{il}", "UNARY", up)
            cur = b.mul_mat(f"ffn_out-{il}", b.weight(f"{blk}.ffn_down", ff, e), act)
            cur = b.same(f"ffn_out-{il}", "ADD", cur, b.weight(f"{blk}.ffn_down.bias", e))
        cur = b.same(f"ffn_res-{il}", "ADD", cur, ffn_inp)
        inp = b.norm(f"l_out-{il}", cur, f"{blk}.layer_output_norm", op="NORM", bias=True)

    inp.is_output = True
    g.expand(inp)
    if params.embeddings:
        pooling_stage(b, g, params, inp, pooling=shape.embeddings_pooling, device=devices[-1])
    return g

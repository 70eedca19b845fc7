"""llama's graph (`src/models/llama.cpp`), the one most dense decoders share.

```
inp_tokens ─ get_rows(token_embd) ─┐                                          (input layer, on the host)
for each block:                    ▼
  rms_norm · attn_norm ─ Q, K, V = mul_mat ─ rope(Q), rope(K) ─ set_rows into the K/V cache
  flash attention:  flash_attn_ext(Q, K cache, V cache, kq_mask)             [head_v, n_head, tokens]
  otherwise:        kq = mul_mat(K cache, Q) [n_kv, tokens, n_head] ─ soft_max(kq, kq_mask) ─ mul_mat(V, kq) ─ cont
  mul_mat(wo) + residual ─ rms_norm · ffn_norm ─ gate, up = mul_mat ─ swiglu ─ mul_mat(down) + residual
  (with experts, Mixtral-style: the feed-forward is `_graph_moe.moe_ffn`, weights renormalised)
rms_norm · output_norm ─ mul_mat(output) = logits [n_vocab, outputs]        (output layer)
```

Qwen3 is the same graph with an RMS norm of each Q and K head (`attn_q_norm`, `attn_k_norm`) before the
rotation (`QK_NORM_ARCHITECTURES`).
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
from qiip_core.planner._graph_moe import moe_ffn
from qiip_core.planner._shape import ModelShape

__all__ = ["QK_NORM_ARCHITECTURES", "build_llama_graph", "dense_ffn"]

QK_NORM_ARCHITECTURES = frozenset({"qwen3"})
"""Llama-style decoders that RMS-normalise every Q and K head before the rotation (`src/models/qwen3.cpp`:
`attn_q_norm`, `attn_k_norm`); otherwise their graph is llama's."""


def dense_ffn(b: Builder, shape: ModelShape, il: int, cur: Tensor, *, act: str = "GLU") -> Tensor:
    """`build_ffn` with a parallel gate: up and gate projections, the gated activation, the down projection.

    Args:
        b: the builder, on the layer's device.
        shape: the model.
        il: the block.
        cur: the normalised input, `[n_embd, tokens]`.
        act: the fused gated activation op (`GLU`: SwiGLU, GeGLU).

    Returns:
        `[n_embd, tokens]`.
    """
    e, ff, blk = shape.n_embd, shape.layer_ff(il), f"blk.{il}"
    up = b.mul_mat(f"ffn_up-{il}", b.weight(f"{blk}.ffn_up", e, ff), cur)
    gate = b.mul_mat(f"ffn_gate-{il}", b.weight(f"{blk}.ffn_gate", e, ff), cur)
    gated = b.same(f"ffn_act-{il}", act, gate, up)
    return b.mul_mat(f"ffn_out-{il}", b.weight(f"{blk}.ffn_down", ff, e), gated)


def build_llama_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """Build the worst-case prompt-processing graph llama-server reserves its compute buffer for.

    Args:
        shape: the model.
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order, each tensor tagged with its device.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output.
    """
    devices = layer_devices(shape, params)
    n_tok, n_out = reserve_batch(params)
    qk_norm = shape.architecture in QK_NORM_ARCHITECTURES
    e, n_head, dv = shape.n_embd, shape.n_head, shape.head_dim_v
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
        q, k, v = project_qkv(b, shape, il, cur, n_tok=n_tok, inp_pos=inp_pos, qk_norm=qk_norm)
        cur = attention(b, g, il=il, q=q, k=k, v=v, inp=kv, cache_type=params.cache_type, flash_attn=params.flash_attn)
        cur = b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", n_head * dv, e), cur)
        if il == shape.n_layers - 1:
            # Only the output rows go on from the last block.
            cur = b.get_rows("last_attn", cur, out_ids)
            residual = b.get_rows("last_inp", residual, out_ids)
        ffn_inp = b.same(f"ffn_inp-{il}", "ADD", cur, residual)
        cur = b.norm(f"ffn_norm-{il}", ffn_inp, f"{blk}.ffn_norm")
        # Mixtral-style experts (`llama.expert_count` > 0) replace the dense feed-forward in every block.
        ffn = moe_ffn(b, g, shape, il, cur, norm_w=True) if shape.n_expert else dense_ffn(b, shape, il, cur)
        inp = b.same(f"l_out-{il}", "ADD", ffn, ffn_inp)

    output_layer(b, g, shape, params, inp, device=devices[-1])
    return g

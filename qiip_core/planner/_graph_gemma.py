"""Gemma 2 and Gemma 3's graph (`src/models/gemma2.cpp`, `gemma3.cpp`): interleaved sliding-window attention.

```
get_rows(token_embd) · scale(√n_embd)                                        (input layer, on the host)
for each block:
  rms_norm · attn_norm ─ Q, K, V = mul_mat ─ [gemma3: rms_norm · q_norm, k_norm] ─ rope ─ scale(Q)
  attention over the block's cache: the full one (--ctx-size cells) or the sliding-window one
  (pad256(window × slots + ubatch) cells), each with its own mask     [gemma2 without flash attention: softcap]
  mul_mat(wo) ─ rms_norm · post_attention_norm + residual = sa_out
  rms_norm · ffn_norm ─ up, gate = mul_mat ─ geglu ─ mul_mat(down) ─ rms_norm · post_ffw_norm + sa_out
rms_norm · output_norm ─ mul_mat(output) [─ scale, tanh, scale: final logit softcapping]
```

Two caches mean two sets of inputs (indices, mask, rotations), each as wide as its cache; with a window much
smaller than the context, the sliding-window layers attend over far fewer cells than the full ones.
"""

from __future__ import annotations

from qiip_core.planner._graph import (
    Builder,
    Graph,
    GraphParams,
    KvInputs,
    attention,
    embed_tokens,
    kv_inputs,
    layer_devices,
    ne4,
    output_layer,
    project_qkv,
    reserve_batch,
)
from qiip_core.planner._graph_llama import dense_ffn
from qiip_core.planner._shape import ModelShape

__all__ = ["build_gemma_graph"]


def build_gemma_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of a Gemma 2 or Gemma 3 model.

    Args:
        shape: the model (`gemma2` or `gemma3`).
        params: the server settings; `swa_cells` is the sliding-window cache's size when the model has one.

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output, or the model has
            sliding-window layers but `params.swa_cells` is 0.
    """
    devices = layer_devices(shape, params)
    iswa = bool(shape.swa_layers)
    if iswa and params.swa_cells < 1:
        raise ValueError("a model with sliding-window layers needs params.swa_cells.")
    gemma3 = shape.architecture == "gemma3"
    n_tok, n_out = reserve_batch(params)
    e, n_head = shape.n_embd, shape.n_head
    fa, ct = params.flash_attn, params.cache_type
    g = Graph()
    b = Builder(params.host)

    inp = b.same("inp_scaled", "SCALE", embed_tokens(b, g, shape, n_tok))
    inp_pos = b.leaf("inp_pos", "i32", ne4(n_tok))
    full_layers = tuple(il for il in range(shape.n_layers) if not shape.is_swa(il))
    swa_layers = tuple(il for il in range(shape.n_layers) if shape.is_swa(il))
    base = kv_inputs(
        b, shape, layers=full_layers, cells=params.aggregate_context, n_tok=n_tok, flash_attn=fa, cache_type=ct
    )
    sliding: KvInputs | None = None
    if iswa:
        sliding = kv_inputs(
            b, shape, layers=swa_layers, cells=params.swa_cells, n_tok=n_tok, flash_attn=fa, cache_type=ct
        )
    out_ids = b.leaf("out_ids", "i32", ne4(n_out))

    for il in range(shape.n_layers):
        b.device = devices[il]
        blk = f"blk.{il}"
        dv = shape.layer_head_dims(il)[1]
        cur = b.norm(f"attn_norm-{il}", inp, f"{blk}.attn_norm")
        q, k, v = project_qkv(b, shape, il, cur, n_tok=n_tok, inp_pos=inp_pos, qk_norm=gemma3)
        q = b.same(f"Qcur_scaled-{il}", "SCALE", q)
        cache = sliding if sliding is not None and shape.is_swa(il) else base
        cur = attention(
            b, g, il=il, q=q, k=k, v=v, inp=cache, cache_type=ct, flash_attn=fa, iswa=iswa, softcap=not gemma3
        )
        cur = b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", n_head * dv, e), cur)
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, out_ids)
            inp = b.get_rows("last_inp", inp, out_ids)
        cur = b.norm(f"attn_post_norm-{il}", cur, f"{blk}.post_attention_norm")
        sa_out = b.same(f"sa_out-{il}", "ADD", cur, inp)
        cur = b.norm(f"ffn_norm-{il}", sa_out, f"{blk}.ffn_norm")
        cur = b.norm(f"ffn_post_norm-{il}", dense_ffn(b, shape, il, cur), f"{blk}.post_ffw_norm")
        inp = b.same(f"l_out-{il}", "ADD", cur, sa_out)

    softcap = shape.architecture == "gemma2" or shape.final_logit_softcap
    output_layer(b, g, shape, params, inp, device=devices[-1], softcap=softcap)
    return g

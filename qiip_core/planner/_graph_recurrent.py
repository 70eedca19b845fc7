"""The graphs of recurrent and hybrid models: LFM2, Granite 4 hybrid, Mamba and Mamba-2 (`src/models/lfm2.cpp`,
`granite-hybrid.cpp`, `mamba.cpp`).

```
get_rows(token_embd)                                                         (input layer, on the host)
for each block:
  rms_norm · attn_norm, then one of
    a recurrent block (_graph_ssm.py): LFM2's short convolution, a Mamba-2 or a Mamba mixer
    attention (hybrids): as llama's, over the K/V cache of the attention blocks (LFM2: with Q/K norms;
    Granite 4.0-H: without rotary embedding; LFM2 with a sliding window: over the sliding-window cache)
  + residual [Granite: scaled] ─ rms_norm · ffn_norm ─ SwiGLU feed-forward [scaled] + residual
                                                     (Mamba, Mamba-2: the residual only)
rms_norm · output_norm ─ mul_mat(output) = logits                            (Granite: ÷ logit_scale)
```

The inputs are the token embedding, the recurrent inputs (`rs_s_copy`), the attention blocks' K/V inputs, the
positions and the output rows; leafs enter the graph in the order blocks first read them, as in ggml.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qiip_core.planner._graph import (
    Builder,
    Graph,
    GraphParams,
    KvInputs,
    Tensor,
    attention,
    embed_tokens,
    kv_inputs,
    layer_devices,
    ne4,
    project_qkv,
    reserve_batch,
)
from qiip_core.planner._graph_llama import dense_ffn
from qiip_core.planner._graph_ssm import RsInputs, mamba2_block, mamba_block, rs_inputs, shortconv_block
from qiip_core.planner._shape import ModelShape

__all__ = ["build_granite_hybrid_graph", "build_lfm2_graph", "build_mamba_graph"]


def _output(
    b: Builder, g: Graph, shape: ModelShape, params: GraphParams, inp: Tensor, *, logits: bool, logit_scale: bool
) -> None:
    """The output norm, the logits (optionally divided by `logit_scale`) and mean pooling with embeddings."""
    b.device = params.layer_devices[-1] if params.layer_devices else params.host
    device = b.device
    result_norm = b.norm("result_norm", inp, "output_norm")
    result_norm.is_output = True
    if logits:
        out = b.mul_mat("result_output", b.weight("output.weight", shape.n_embd, shape.n_vocab), result_norm)
        if logit_scale:
            out = b.same("result_output", "SCALE", out)
        out.is_output = True
        g.expand(out)
    else:
        g.expand(result_norm)
    if params.embeddings:
        # build_pooling, mean: mul_mat(cont(transpose(embd)), inp_mean [tokens, slots]).
        b.device = params.host
        inp_mean = b.leaf("inp_mean", "f32", ne4(reserve_batch(params)[0], params.slots))
        b.device = device
        transposed = b.permute(result_norm, (1, 0, 2, 3))
        cont = b.new("cont", "CONT", "f32", ne4(transposed.ne[0], transposed.ne[1]), transposed)
        pooled = b.mul_mat("result_embd_pooled", cont, inp_mean)
        pooled.is_output = True
        g.expand(pooled)


@dataclass(slots=True)
class _Context:
    """What every block of one graph shares: builder, graph, inputs, batch."""

    b: Builder
    g: Graph
    devices: tuple[int, ...]
    n_tok: int
    n_seqs: int
    rs: RsInputs
    kv: KvInputs | None
    inp_pos: Tensor | None
    out_ids: Tensor


def _start(
    shape: ModelShape, params: GraphParams, *, attention: bool, rope: bool = True, iswa: bool = False
) -> tuple[_Context, Tensor]:
    """The input embedding and the inputs, in the order the graphs create them.

    With `iswa` (LFM2 with a sliding window: every attention block slides) the blocks attend over the
    sliding-window cache; `build_inp_mem_hybrid_iswa` builds no Hadamard rotations, and the full cache's inputs,
    which no block reads, never enter the graph.
    """
    devices = layer_devices(shape, params)
    n_tok, n_out = reserve_batch(params)
    g, b = Graph(), Builder(params.host)
    inp = embed_tokens(b, g, shape, n_tok)
    rs = rs_inputs(b, cells=max(1, params.slots), n_seqs=params.slots)
    kv = None
    if attention:
        kv = kv_inputs(
            b,
            shape,
            layers=shape.attention_layers(),
            cells=params.swa_cells if iswa else params.aggregate_context,
            n_tok=n_tok,
            flash_attn=params.flash_attn,
            cache_type=params.cache_type,
        )
        if iswa:
            kv = replace(kv, k_rot=None, v_rot=None)
    inp_pos = b.leaf("inp_pos", "i32", ne4(n_tok)) if attention and rope else None
    out_ids = b.leaf("out_ids", "i32", ne4(n_out))
    return _Context(b, g, devices, n_tok, params.slots, rs, kv, inp_pos, out_ids), inp


def _attention_block(
    c: _Context, shape: ModelShape, params: GraphParams, il: int, cur: Tensor, *, qk_norm: bool
) -> Tensor:
    """Q, K, V projections, [Q/K norms], rope, attention and the output projection (`build_attn`)."""
    if c.kv is None:
        raise ValueError("an attention block needs the K/V inputs.")
    b, blk, e = c.b, f"blk.{il}", shape.n_embd
    dv = shape.layer_head_dims(il)[1]
    q, k, v = project_qkv(b, shape, il, cur, n_tok=c.n_tok, inp_pos=c.inp_pos, qk_norm=qk_norm)
    cur = attention(b, c.g, il=il, q=q, k=k, v=v, inp=c.kv, cache_type=params.cache_type, flash_attn=params.flash_attn)
    return b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", shape.n_head * dv, e), cur)


def build_lfm2_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of an LFM2 model (`llama_model_lfm2::graph`).

    Args:
        shape: the model (`lfm2`): short-convolution blocks where `is_recurrent`, attention elsewhere.
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output, or the model has
            a sliding window but `params.swa_cells` is 0.
    """
    iswa = shape.memory == "hybrid_iswa"
    if iswa and params.swa_cells < 1:
        raise ValueError("an LFM2 model with a sliding window needs params.swa_cells.")
    c, inp = _start(shape, params, attention=True, iswa=iswa)
    b = c.b
    for il in range(shape.n_layers):
        b.device = c.devices[il]
        residual = inp
        cur = b.norm(f"operator_norm-{il}", inp, f"blk.{il}.attn_norm")
        if shape.is_recurrent(il):
            cur = shortconv_block(b, c.g, shape, il, cur, c.rs, n_seqs=c.n_seqs)
        else:
            cur = _attention_block(c, shape, params, il, cur, qk_norm=True)
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, c.out_ids)
            residual = b.get_rows("last_inp", residual, c.out_ids)
        cur = b.same(f"attn_res-{il}", "ADD", residual, cur)
        ffn_out = dense_ffn(b, shape, il, b.norm(f"ffn_norm-{il}", cur, f"blk.{il}.ffn_norm"))
        inp = b.same(f"l_out-{il}", "ADD", cur, ffn_out)
    # With --embeddings LFM2 stops at the normalised embeddings: no output projection.
    _output(b, c.g, shape, params, inp, logits=not params.embeddings, logit_scale=False)
    return c.g


def build_granite_hybrid_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of a Granite 4 hybrid (`llama_model_granite_hybrid::graph`), dense feed-forward.

    Args:
        shape: the model (`granitehybrid`): Mamba-2 blocks where `is_recurrent`, attention elsewhere.
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output.
    """
    c, inp = _start(shape, params, attention=bool(shape.attention_layers()), rope=shape.rope)
    b = c.b
    for il in range(shape.n_layers):
        b.device = c.devices[il]
        residual = inp
        cur = b.norm(f"attn_norm-{il}", inp, f"blk.{il}.attn_norm")
        if shape.is_recurrent(il):
            cur = mamba2_block(b, c.g, shape, il, cur, c.rs, n_seqs=c.n_seqs)
        else:
            cur = _attention_block(c, shape, params, il, cur, qk_norm=False)
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, c.out_ids)
            residual = b.get_rows("last_inp", residual, c.out_ids)
        if shape.residual_scale:
            cur = b.same(f"attn_scaled-{il}", "SCALE", cur)
        ffn_inp = b.same(f"ffn_inp-{il}", "ADD", cur, residual)
        cur = dense_ffn(b, shape, il, b.norm(f"ffn_norm-{il}", ffn_inp, f"blk.{il}.ffn_norm"))
        if shape.residual_scale:
            cur = b.same(f"ffn_scaled-{il}", "SCALE", cur)
        inp = b.same(f"l_out-{il}", "ADD", cur, ffn_inp)
    _output(b, c.g, shape, params, inp, logits=True, logit_scale=bool(shape.logit_scale))
    return c.g


def build_mamba_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """The reserved graph of a Mamba or Mamba-2 model (`llama_model_mamba::graph`).

    Args:
        shape: the model (`mamba` or `mamba2`): every block recurrent.
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order.

    Raises:
        ValueError: `layer_devices` does not have one entry per layer and one for the output.
    """
    block = mamba2_block if shape.architecture == "mamba2" else mamba_block
    c, inp = _start(shape, params, attention=False)
    b = c.b
    for il in range(shape.n_layers):
        b.device = c.devices[il]
        residual = inp
        cur = b.norm(f"attn_norm-{il}", inp, f"blk.{il}.attn_norm")
        cur = block(b, c.g, shape, il, cur, c.rs, n_seqs=c.n_seqs)
        if il == shape.n_layers - 1:
            cur = b.get_rows("last_attn", cur, c.out_ids)
            residual = b.get_rows("last_inp", residual, c.out_ids)
        inp = b.same(f"l_out-{il}", "ADD", cur, residual)
    _output(b, c.g, shape, params, inp, logits=True, logit_scale=False)
    return c.g

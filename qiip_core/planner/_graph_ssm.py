"""The recurrent blocks of llama.cpp's graphs, and the recurrent state they read and write.

A recurrent block keeps one state per sequence instead of K/V rows per token. In the reserved graph every block
reads its state rows through the recurrent inputs (`build_rs`: zero the cleared cell in place, `get_rows` the
sequences' cells, copy the others), runs its convolution over the state and the new tokens, and writes the last
columns back into the state cache (`cpy` into a view of it). Views and copies into the cache cost nothing in the
compute buffer; the gathered states, the concatenated convolution input and the scan's output do.

```
rs_s_copy [cells] ─ view: the batch's sequences, view: the others          (build_rs_inp_impl, once per graph)
LFM2 short convolution (lfm2.cpp):   in_proj ─ b, c, x views ─ bx = b·x, transposed
    concat(get_rows(R cache, s_copy), bx) ─ cpy last columns into R ─ ssm_conv ─ c·conv ─ out_proj
Mamba-2 (mamba-base.cpp):            in_proj ─ z, xBC, dt views ─ concat(get_rows(R cache), xBCᵀ) ─ cpy into R
    ssm_conv + bias ─ silu ─ ssm_scan(S cache, x, dt, A, B, C, s_copy) [y, then the new states] ─ cpy into S
    y + x·D ─ swiglu(z, y) ─ grouped rms_norm ─ out_proj
Mamba (mamba-base.cpp):              in_proj ─ x, z ─ concat(get_rows(R), xᵀ) ─ cpy into R ─ ssm_conv + bias ─ silu
    x_proj ─ dt, B, C [Falcon-Mamba: rms_norm each] ─ dt_proj + bias ─ ssm_scan ─ cpy into S
    y + x·D ─ swiglu(z, y) ─ out_proj
```

The reserved micro-batch holds `slots` sequences of `tokens / slots` tokens each (`ubatch_reserve`), and the
recurrent cache has one cell per slot, all visible (`init_full`: head 0, every cell, no cleared cell). No
rollback snapshots are reserved (`n_rs_seq` is 0 without speculative decoding), so each block writes one state.
The architectures' graphs are in `_graph_recurrent.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from qiip_core.planner._graph import Builder, Graph, Tensor, ne4
from qiip_core.planner._memory import RECURRENT_TYPE, recurrent_state_widths
from qiip_core.planner._shape import ModelShape, SsmShape

__all__ = ["RsInputs", "build_rs", "mamba2_block", "mamba_block", "rs_inputs", "shortconv_block"]


@dataclass(frozen=True, slots=True)
class RsInputs:
    """The recurrent inputs (`build_rs_inp_impl`): which cell each sequence reads its state from."""

    main: Tensor
    """`s_copy_main`: a view of `rs_s_copy` over the batch's sequences."""
    extra: Tensor
    """`s_copy_extra`: a view over the other cells (none in the reserved graph: one cell per slot)."""
    cells: int
    """Cells of the recurrent cache (`n_rs`, all visible in the reserved graph)."""


def rs_inputs(b: Builder, *, cells: int, n_seqs: int) -> RsInputs:
    """`build_rs_inp_impl`: the I32 `rs_s_copy` input and its two views.

    Args:
        b: the builder, on the host device.
        cells: cells of the recurrent cache (`max(1, slots)`).
        n_seqs: sequences of the micro-batch (the slots).
    """
    s_copy = b.leaf("rs_s_copy", "i32", ne4(cells))
    main = b.view(s_copy, ne4(n_seqs), s_copy.nb)
    extra = b.view(s_copy, ne4(cells - n_seqs), s_copy.nb)
    return RsInputs(main, extra, cells)


def _root(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


def _view(b: Builder, a: Tensor, *ne: int) -> Tensor:
    """`ggml_view_Nd` of `a`: strides do not matter to memory, only that it is a view of `a`'s root."""
    shape = ne4(*ne)
    nb0 = a.nb[0]
    return b.view(a, shape, (nb0, nb0 * shape[0], nb0 * shape[0] * shape[1], nb0 * shape[0] * shape[1] * shape[2]))


def _cpy(src: Tensor, dst: Tensor) -> Tensor:
    """`ggml_cpy`: the result is a view of the destination (here always the recurrent cache)."""
    root = _root(dst)
    return Tensor(dst.name, "CPY", dst.dtype, dst.ne, dst.nb, src=(src, dst), view_src=root, device=root.device)


def _transpose(b: Builder, a: Tensor) -> Tensor:
    return b.view(a, ne4(a.ne[1], a.ne[0], a.ne[2], a.ne[3]), (a.nb[1], a.nb[0], a.nb[2], a.nb[3]), "TRANSPOSE")


def _concat0(b: Builder, name: str, a: Tensor, c: Tensor) -> Tensor:
    """`ggml_concat(a, c, 0)`: a new tensor, `a`'s type, the first dimensions added."""
    return b.new(name, "CONCAT", a.dtype, ne4(a.ne[0] + c.ne[0], a.ne[1], a.ne[2], a.ne[3]), a, c)


def _ssm_conv(b: Builder, name: str, sx: Tensor, kernel: Tensor) -> Tensor:
    """`ggml_ssm_conv`: `[channels, tokens per sequence, sequences]` F32."""
    d_conv, channels = kernel.ne[0], kernel.ne[1]
    return b.new(name, "SSM_CONV", "f32", ne4(channels, sx.ne[0] - d_conv + 1, sx.ne[2]), sx, kernel)


def build_rs(
    b: Builder,
    g: Graph,
    inp: RsInputs,
    cache: Tensor,
    *,
    state_size: int,
    n_seqs: int,
    scan: tuple[Tensor, ...] | None = None,
    scan_shape: tuple[int, int, int] = (0, 0, 0),
) -> Tensor:
    """`llm_graph_context::build_rs`: read the sequences' states out of one recurrent cache.

    Clears the zeroed cell in place (a `scale` view of the cache), gathers the sequences' rows (`get_rows`, or
    for a Mamba mixer's S state the scan itself, which reads the cache through `s_copy`), and copies the other
    cells (none in the reserved graph).

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        inp: the recurrent inputs.
        cache: the layer's R or S cache, `[state_size, cells]` F32.
        state_size: elements of one cell's state (`n_embd_r` or `n_embd_s`).
        n_seqs: sequences of the micro-batch.
        scan: for the S state, the scan's other sources `(x, dt, A, B, C)`; None gathers rows.
        scan_shape: for the S state, `(d_state, head_dim, n_head)` of the state view.

    Returns:
        The gathered states `[state_size, n_seqs]`, or the scan's output.
    """
    states = b.reshape(cache, ne4(state_size, cache.ne[1]))
    zero = _view(b, states, state_size)
    g.expand(b.view(zero, zero.ne, zero.nb, "SCALE"))
    if scan is None:
        out = b.new("rs_rows", "GET_ROWS", "f32", ne4(state_size, n_seqs), states, inp.main)
    else:
        x = scan[0]
        d_state, head_dim, n_head = scan_shape
        ssm = b.reshape(states, ne4(d_state, head_dim, n_head, cache.ne[1]))
        elements = x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3] + d_state * head_dim * n_head * n_seqs
        out = b.new("ssm_scan", "SSM_SCAN", "f32", ne4(elements), ssm, *scan, inp.main)
    g.expand(out)
    extra = b.new("rs_extra", "GET_ROWS", "f32", ne4(state_size, inp.cells - n_seqs), states, inp.extra)
    g.expand(_cpy(extra, _view(b, cache, state_size, inp.cells - n_seqs)))
    return out


def _recurrent_cache(b: Builder, shape: ModelShape, il: int, cells: int) -> tuple[Tensor, Tensor]:
    """The R and S caches of block `il` (`cache_r_l<il>`, `cache_s_l<il>`), outside the compute buffer."""
    r, s = recurrent_state_widths(shape)
    cache_r = b.leaf(f"cache_r_l{il}", RECURRENT_TYPE, ne4(r, cells), external=True)
    cache_s = b.leaf(f"cache_s_l{il}", RECURRENT_TYPE, ne4(s, cells), external=True)
    return cache_r, cache_s


def shortconv_block(
    b: Builder, g: Graph, shape: ModelShape, il: int, cur: Tensor, inp: RsInputs, *, n_seqs: int
) -> Tensor:
    """LFM2's short convolution (`build_shortconv_block` in `lfm2.cpp`).

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        shape: the model (`shortconv_cache` is the convolution's width).
        il: the block.
        cur: the normalised input, `[n_embd, tokens]`.
        inp: the recurrent inputs.
        n_seqs: sequences of the micro-batch.

    Returns:
        `[n_embd, tokens]`.
    """
    e, blk = shape.n_embd, f"blk.{il}"
    n_tok = cur.ne[1]
    seq_tokens = n_tok // n_seqs
    d_conv = shape.shortconv_cache - 1
    cur = b.reshape(cur, ne4(e, seq_tokens, n_seqs))
    bcx = b.mul_mat(f"conv.in_proj-{il}", b.weight(f"{blk}.shortconv.in_proj", e, 3 * e), cur)
    gate_b, gate_c, x = (_view(b, bcx, e, seq_tokens, n_seqs) for _ in range(3))
    bx = _transpose(b, b.new(f"bx-{il}", "MUL", "f32", gate_b.ne, gate_b, x))
    cache_r, _ = _recurrent_cache(b, shape, il, inp.cells)
    conv = build_rs(b, g, inp, cache_r, state_size=cache_r.ne[0], n_seqs=n_seqs)
    conv = b.reshape(conv, ne4(d_conv, e, n_seqs))
    bx = _concat0(b, f"bx_concat-{il}", conv, bx)
    # The last d_conv columns become the sequence's new state (n_rs_seq = 0: one snapshot).
    g.expand(_cpy(_view(b, bx, d_conv, e, n_seqs), _view(b, cache_r, d_conv * e, n_seqs)))
    kernel = b.leaf(f"{blk}.shortconv.conv.weight", "f32", ne4(shape.shortconv_cache, e), external=True)
    conv_out = _ssm_conv(b, f"conv.conv-{il}", bx, kernel)
    y = b.same(f"conv_y-{il}", "MUL", gate_c, conv_out)
    y = b.mul_mat(f"conv.out_proj-{il}", b.weight(f"{blk}.shortconv.out_proj", e, e), y)
    return b.reshape(y, ne4(e, n_tok))


def mamba2_block(
    b: Builder, g: Graph, shape: ModelShape, il: int, cur: Tensor, inp: RsInputs, *, n_seqs: int
) -> Tensor:
    """The Mamba-2 mixer (`build_mamba2_layer` in `mamba-base.cpp`).

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        shape: the model (`ssm` holds the widths).
        il: the block.
        cur: the normalised input, `[n_embd, tokens]`.
        inp: the recurrent inputs.
        n_seqs: sequences of the micro-batch.

    Returns:
        `[n_embd, tokens]`.

    Raises:
        ValueError: the model has no state-space widths.
    """
    if shape.ssm is None:
        raise ValueError(f"block {il} is a Mamba-2 block, but the model has no ssm widths.")
    ssm: SsmShape = shape.ssm
    e, blk, n_tok = shape.n_embd, f"blk.{il}", cur.ne[1]
    seq_tokens = n_tok // n_seqs
    d_conv, d_inner, d_state = ssm.conv_kernel, ssm.inner_size, ssm.state_size
    n_head, n_group = ssm.time_step_rank, ssm.group_count
    head_dim, conv_dim = d_inner // n_head, d_inner + 2 * n_group * d_state
    cache_r, cache_s = _recurrent_cache(b, shape, il, inp.cells)
    conv = build_rs(b, g, inp, cache_r, state_size=cache_r.ne[0], n_seqs=n_seqs)
    conv = b.reshape(conv, ne4(d_conv - 1, conv_dim, n_seqs))
    d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head
    zx = b.mul_mat(f"ssm_in-{il}", b.weight(f"{blk}.ssm_in", e, d_in_proj), cur)
    zx = b.reshape(zx, ne4(d_in_proj, seq_tokens, n_seqs))
    z = _view(b, zx, head_dim, n_head, seq_tokens, n_seqs)
    xbc = _view(b, zx, conv_dim, seq_tokens, n_seqs)
    dt = _view(b, zx, n_head, seq_tokens, n_seqs)
    conv_x = _concat0(b, f"conv_x-{il}", conv, _transpose(b, xbc))
    g.expand(_cpy(_view(b, conv_x, d_conv - 1, conv_dim, n_seqs), _view(b, cache_r, cache_r.ne[0], n_seqs)))
    kernel = b.leaf(f"{blk}.ssm_conv1d.weight", "f32", ne4(d_conv, conv_dim), external=True)
    xbc = _ssm_conv(b, f"ssm_conv-{il}", conv_x, kernel)
    xbc = b.same(f"ssm_conv_b-{il}", "ADD", xbc, b.leaf(f"{blk}.ssm_conv1d.bias", "f32", ne4(conv_dim), external=True))
    xbc = b.same(f"ssm_conv_silu-{il}", "UNARY", xbc)
    x = _view(b, xbc, head_dim, n_head, seq_tokens, n_seqs)
    gate_b = _view(b, xbc, d_state, n_group, seq_tokens, n_seqs)
    gate_c = _view(b, xbc, d_state, n_group, seq_tokens, n_seqs)
    dt = b.new(f"dt_cont-{il}", "CONT", "f32", dt.ne, dt)
    dt = b.same(f"dt-{il}", "ADD", dt, b.leaf(f"{blk}.ssm_dt.bias", "f32", ne4(n_head), external=True))
    a = b.leaf(f"{blk}.ssm_a", "f32", ne4(1, n_head), external=True)
    y_ssm = build_rs(
        b,
        g,
        inp,
        cache_s,
        state_size=cache_s.ne[0],
        n_seqs=n_seqs,
        scan=(x, dt, a, gate_b, gate_c),
        scan_shape=(d_state, head_dim, n_head),
    )
    # The scan's new states, after its y, go back into the S cache.
    g.expand(_cpy(_view(b, y_ssm, d_state * d_inner, n_seqs), _view(b, cache_s, d_state * d_inner, n_seqs)))
    y = _view(b, y_ssm, head_dim, n_head, seq_tokens, n_seqs)
    d = b.leaf(f"{blk}.ssm_d", "f32", ne4(1, n_head), external=True)
    y = b.same(f"mamba2_y_add_d-{il}", "ADD", y, b.new(f"y_xd-{il}", "MUL", "f32", x.ne, x, d))
    z = b.new(f"z_cont-{il}", "CONT", "f32", z.ne, z)
    y = b.same(f"y_gated-{il}", "GLU", z, y)
    y = b.reshape(y, ne4(d_inner // n_group, n_group, seq_tokens, n_seqs))
    y = b.norm(f"ssm_norm-{il}", y, f"{blk}.ssm_norm")
    y = b.reshape(y, ne4(d_inner, n_tok))
    return b.mul_mat(f"mamba_out-{il}", b.weight(f"{blk}.ssm_out", d_inner, e), y)


def mamba_block(b: Builder, g: Graph, shape: ModelShape, il: int, cur: Tensor, inp: RsInputs, *, n_seqs: int) -> Tensor:
    """The Mamba (1) mixer (`build_mamba_layer` in `mamba-base.cpp`), with Falcon-Mamba's Δ/B/C norms.

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        shape: the model (`ssm` holds the widths; `time_step_rank` is Δ's rank).
        il: the block.
        cur: the normalised input, `[n_embd, tokens]`.
        inp: the recurrent inputs.
        n_seqs: sequences of the micro-batch.

    Returns:
        `[n_embd, tokens]`.

    Raises:
        ValueError: the model has no state-space widths.
    """
    if shape.ssm is None:
        raise ValueError(f"block {il} is a Mamba block, but the model has no ssm widths.")
    ssm: SsmShape = shape.ssm
    e, blk, n_tok = shape.n_embd, f"blk.{il}", cur.ne[1]
    seq_tokens = n_tok // n_seqs
    d_conv, d_inner, d_state, dt_rank = ssm.conv_kernel, ssm.inner_size, ssm.state_size, ssm.time_step_rank
    cache_r, cache_s = _recurrent_cache(b, shape, il, inp.cells)
    conv = build_rs(b, g, inp, cache_r, state_size=cache_r.ne[0], n_seqs=n_seqs)
    conv = b.reshape(conv, ne4(d_conv - 1, d_inner, n_seqs))
    cur = b.reshape(cur, ne4(e, seq_tokens, n_seqs))
    xz = b.mul_mat(f"ssm_in-{il}", b.weight(f"{blk}.ssm_in", e, 2 * d_inner), cur)
    x = _view(b, xz, d_inner, seq_tokens, n_seqs)
    z = _view(b, xz, d_inner, seq_tokens, n_seqs)
    conv_x = _concat0(b, f"conv_x-{il}", conv, _transpose(b, x))
    g.expand(_cpy(_view(b, conv_x, d_conv - 1, d_inner, n_seqs), _view(b, cache_r, cache_r.ne[0] * n_seqs)))
    kernel = b.leaf(f"{blk}.ssm_conv1d.weight", "f32", ne4(d_conv, d_inner), external=True)
    x = _ssm_conv(b, f"ssm_conv-{il}", conv_x, kernel)
    x = b.same(f"ssm_conv_b-{il}", "ADD", x, b.leaf(f"{blk}.ssm_conv1d.bias", "f32", ne4(d_inner), external=True))
    x = b.same(f"ssm_conv_silu-{il}", "UNARY", x)
    x_db = b.mul_mat(f"ssm_x-{il}", b.weight(f"{blk}.ssm_x", d_inner, dt_rank + 2 * d_state), x)
    dt = _view(b, x_db, dt_rank, seq_tokens, n_seqs)
    gate_b = _view(b, x_db, d_state, 1, seq_tokens, n_seqs)
    gate_c = _view(b, x_db, d_state, 1, seq_tokens, n_seqs)
    if ssm.dt_b_c_rms:
        # Falcon-Mamba: weightless RMS norms (build_norm without a weight is the norm alone).
        dt = b.same(f"dt_norm-{il}", "RMS_NORM", dt)
        gate_b = b.same(f"b_norm-{il}", "RMS_NORM", gate_b)
        gate_c = b.same(f"c_norm-{il}", "RMS_NORM", gate_c)
    else:
        dt = b.new(f"dt_cont-{il}", "CONT", "f32", dt.ne, dt)
    dt = b.mul_mat(f"ssm_dt-{il}", b.weight(f"{blk}.ssm_dt", dt_rank, d_inner), dt)
    dt = b.same(f"dt-{il}", "ADD", dt, b.leaf(f"{blk}.ssm_dt.bias", "f32", ne4(d_inner), external=True))
    xc = x
    x = b.reshape(x, ne4(1, d_inner, seq_tokens, n_seqs))
    a = b.leaf(f"{blk}.ssm_a", "f32", ne4(d_state, d_inner), external=True)
    y_ssm = build_rs(
        b,
        g,
        inp,
        cache_s,
        state_size=cache_s.ne[0],
        n_seqs=n_seqs,
        scan=(x, dt, a, gate_b, gate_c),
        scan_shape=(d_state, 1, d_inner),
    )
    g.expand(_cpy(_view(b, y_ssm, d_state * d_inner * n_seqs), _view(b, cache_s, d_state * d_inner * n_seqs)))
    y = _view(b, y_ssm, d_inner, seq_tokens, n_seqs)
    d = b.leaf(f"{blk}.ssm_d", "f32", ne4(d_inner), external=True)
    y = b.same(f"y_add_d-{il}", "ADD", y, b.same(f"y_xd-{il}", "MUL", xc, d))
    z = b.new(f"z_cont-{il}", "CONT", "f32", z.ne, z)
    y = b.same(f"y_gated-{il}", "GLU", z, y)
    cur = b.mul_mat(f"ssm_out-{il}", b.weight(f"{blk}.ssm_out", d_inner, e), y)
    return b.reshape(cur, ne4(e, n_tok))

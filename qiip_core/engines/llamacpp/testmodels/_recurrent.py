"""Test-model writers for recurrent and hybrid architectures: LFM2, Granite 4 hybrid, Mamba-2, Mamba.

These models keep recurrent state per sequence (`llama_memory_recurrent`) next to, or instead of, a K/V cache,
so the planner's recurrent memory and its graphs of short-convolution and Mamba-2 layers can be checked against a
real llama-server. Each writer lays its tensors out as llama.cpp's loader expects them (`load_arch_tensors` in
`src/models/<arch>.cpp`) and writes the keys its `load_arch_hparams` reads:

```
lfm2            attention blocks where head_count_kv[il] > 0, short-convolution blocks where it is 0
                (shortconv.l_cache), a SwiGLU feed-forward after every block
granitehybrid   attention blocks where head_count_kv[il] > 0, Mamba-2 blocks where it is 0 (ssm.*),
                a SwiGLU feed-forward after every block
mamba2          Mamba-2 blocks only, no feed-forward, no attention
mamba           Mamba blocks only (optionally Falcon-Mamba's Δ/B/C norms: ssm.dt_b_c_rms)
```

Which blocks attend is an option (`attention_period`: every n-th block, counting from the n-th), so one writer
covers the layouts of the published models (LFM2-350M attends in 6 of 16 blocks, Granite 4.0-H in 1 of 10).
Matrices are F16; what llama.cpp's CPU kernels read as F32 (convolution kernels, the A and D vectors, biases,
norms) is F32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qiip_core.engines.llamacpp.testmodels._generate import Option, Tensors, TestModelSpec, Weights, check_options

__all__ = ["granitehybrid_writer", "lfm2_writer", "mamba2_writer", "mamba_writer"]


def _attention_blocks(architecture: str, spec: TestModelSpec, default_period: int) -> tuple[bool, ...]:
    """Which blocks attend: every `attention_period`-th block, the `attention_period`-th first.

    A hybrid needs both kinds of block (llama.cpp cannot build a hybrid memory without attention, nor a recurrent
    state without recurrent blocks): the default period is shortened to fit a small model, and a period that
    leaves no block of one kind is refused.
    """
    if spec.n_layers < 2:
        raise ValueError(
            f"{spec.name('architecture')} {architecture} needs at least 2 layers: one attends, one is recurrent."
        )
    period = int(spec.option("attention_period", min(default_period, spec.n_layers)))
    if not 2 <= period <= spec.n_layers:
        raise ValueError(
            f"option attention_period of {spec.name('architecture')} {architecture} must be between 2 and the layer "
            f"count ({spec.n_layers}), so that some blocks attend and the others are recurrent; got {period}."
        )
    return tuple((il + 1) % period == 0 for il in range(spec.n_layers))


def _ffn(blk: str, spec: TestModelSpec, w: Weights) -> Tensors:
    e = spec.n_embd
    return [
        (f"{blk}.ffn_norm.weight", w.norm(e)),
        (f"{blk}.ffn_gate.weight", w.matrix(spec.n_ff, e)),
        (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
        (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
    ]


def _attention(blk: str, spec: TestModelSpec, w: Weights, *, qk_norm: bool) -> Tensors:
    e, hd = spec.n_embd, spec.head_dim
    tensors: Tensors = []
    if qk_norm:
        tensors += [(f"{blk}.attn_q_norm.weight", w.norm(hd)), (f"{blk}.attn_k_norm.weight", w.norm(hd))]
    return tensors + [
        (f"{blk}.attn_q.weight", w.matrix(spec.n_head * hd, e)),
        (f"{blk}.attn_k.weight", w.matrix(spec.n_head_kv * hd, e)),
        (f"{blk}.attn_v.weight", w.matrix(spec.n_head_kv * hd, e)),
        (f"{blk}.attn_output.weight", w.matrix(e, spec.n_head * hd)),
    ]


def _f32_matrix(w: Weights, rows: int, cols: int) -> Any:
    return w.matrix(rows, cols).astype(w.np.float32)


def _ssm_widths(architecture: str, spec: TestModelSpec) -> tuple[int, int, int, int, int]:
    """(d_conv, d_inner, d_state, n_ssm_head, n_group) of a Mamba-2 block, from the options."""
    d_conv = int(spec.option("ssm_conv_kernel", 4))
    d_inner = 2 * spec.n_embd  # llama.cpp supports an expansion factor of 2 only
    d_state = int(spec.option("ssm_state_size", 16))
    n_ssm_head = int(spec.option("ssm_head_count", max(1, d_inner // 16)))
    n_group = int(spec.option("ssm_group_count", 1))
    if d_conv < 2:
        raise ValueError(
            f"option ssm_conv_kernel of {spec.name('architecture')} {architecture} must be at least 2, got {d_conv}."
        )
    if d_state < 1 or n_ssm_head < 1 or n_group < 1:
        raise ValueError(f"the ssm options of {spec.name('architecture')} {architecture} must be at least 1.")
    if d_inner % n_ssm_head or d_inner % n_group:
        raise ValueError(
            f"ssm_head_count ({n_ssm_head}) and ssm_group_count ({n_group}) must divide the inner width "
            f"2 * {spec.name('n_embd')} = {d_inner} of {spec.name('architecture')} {architecture}."
        )
    return d_conv, d_inner, d_state, n_ssm_head, n_group


def _mamba2_block(blk: str, spec: TestModelSpec, w: Weights, widths: tuple[int, int, int, int, int]) -> Tensors:
    """`build_mamba2_layer`'s weights: in-projection to z, x, B, C, dt; the causal convolution; A, D; the norm."""
    d_conv, d_inner, d_state, n_head, n_group = widths
    conv_dim = d_inner + 2 * n_group * d_state
    np = w.np
    # A must be negative for a decaying state; llama.cpp stores it already negated (-exp(A_log)).
    a = -np.exp(w.rng.uniform(0.0, 1.0, size=(n_head, 1)).astype(np.float32))
    return [
        (f"{blk}.ssm_in.weight", w.matrix(2 * d_inner + 2 * n_group * d_state + n_head, spec.n_embd)),
        (f"{blk}.ssm_conv1d.weight", _f32_matrix(w, conv_dim, d_conv)),
        (f"{blk}.ssm_conv1d.bias", w.vector(conv_dim)),
        (f"{blk}.ssm_dt.bias", w.vector(n_head)),
        (f"{blk}.ssm_a", a),
        (f"{blk}.ssm_d", np.ones((n_head, 1), dtype=np.float32)),
        (f"{blk}.ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32)),
        (f"{blk}.ssm_out.weight", w.matrix(spec.n_embd, d_inner)),
    ]


def _add_ssm_metadata(writer: Any, widths: tuple[int, int, int, int, int]) -> None:
    d_conv, d_inner, d_state, n_head, n_group = widths
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(n_head)
    writer.add_ssm_group_count(n_group)


def _add_hybrid_metadata(writer: Any, spec: TestModelSpec, attends: tuple[bool, ...]) -> None:
    """The attention keys of a hybrid: `head_count_kv` per block, 0 marking a recurrent block (`is_recr`)."""
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv([spec.n_head_kv if a else 0 for a in attends])
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)


def lfm2_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """LFM2: short-convolution blocks and attention blocks with Q/K norms, a SwiGLU feed-forward after each.

    Options:
        attention_period (int): every n-th block attends (default 3); the others are short convolutions.
        l_cache (int): the short convolution's width in tokens, `shortconv.l_cache` (default 3).
        tied_output (bool): the output projection reuses the token embedding, as the published models do
            (default False).
        sliding_window (int): `attention.sliding_window` in tokens; above 0 every attention block slides
            (llama.cpp then builds `llama_memory_hybrid_iswa`). Default 0: full attention.
    """
    known = {
        "attention_period": Option(int, minimum=2),
        "l_cache": Option(int, minimum=2, maximum=16),
        "tied_output": Option(bool),
        "sliding_window": Option(int, minimum=0),
    }
    check_options(spec, known)
    attends = _attention_blocks("lfm2", spec, 3)
    l_cache = int(spec.option("l_cache", 3))
    if l_cache < 2:
        raise ValueError(f"option l_cache of {spec.arch} must be at least 2 tokens, got {l_cache}.")
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for il in range(spec.n_layers):
        blk = f"blk.{il}"
        tensors += [(f"{blk}.attn_norm.weight", w.norm(e))]
        if attends[il]:
            tensors += _attention(blk, spec, w, qk_norm=True)
        else:
            tensors += [
                (f"{blk}.shortconv.conv.weight", _f32_matrix(w, e, l_cache)),
                (f"{blk}.shortconv.in_proj.weight", w.matrix(3 * e, e)),
                (f"{blk}.shortconv.out_proj.weight", w.matrix(e, e)),
            ]
        tensors += _ffn(blk, spec, w)
    # llama.cpp loads LFM2's output norm under the name `token_embd_norm` (LLM_TENSOR_OUTPUT_NORM_LFM2).
    tensors += [("token_embd_norm.weight", w.norm(e))]
    if not spec.option("tied_output", False):
        tensors += [("output.weight", w.matrix(spec.n_vocab, e))]

    def metadata(writer: Any) -> None:
        _add_hybrid_metadata(writer, spec, attends)
        writer.add_shortconv_l_cache(l_cache)
        window = int(spec.option("sliding_window", 0))
        if window:
            writer.add_sliding_window(window)

    return tensors, metadata


def granitehybrid_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Granite 4 hybrid: Mamba-2 blocks and attention blocks, a SwiGLU feed-forward after each.

    Options:
        attention_period (int): every n-th block attends (default 4); the others are Mamba-2 blocks.
        ssm_conv_kernel (int): `ssm.conv_kernel` (default 4).
        ssm_state_size (int): `ssm.state_size` (default 16).
        ssm_head_count (int): `ssm.time_step_rank`, Mamba-2's heads (default `2 * n_embd / 16`).
        ssm_group_count (int): `ssm.group_count` (default 1).
        residual_scale (float): `residual_scale`, scaling each block's output (default 0: none).
        logit_scale (float): `logit_scale`, dividing the logits (default 0: none).
        rope (bool): attention blocks use rotary embeddings (default True); False writes
            `rope.scaling.finetuned = false`, as the published Granite 4.0-H models (no positional encoding).
    """
    known = {
        "attention_period": Option(int, minimum=2),
        "ssm_conv_kernel": Option(int, minimum=2, maximum=16),
        "ssm_state_size": Option(int, minimum=1, maximum=1024),
        "ssm_head_count": Option(int, minimum=1),
        "ssm_group_count": Option(int, minimum=1),
        "residual_scale": Option(float, minimum=0),
        "logit_scale": Option(float, minimum=0),
        "rope": Option(bool),
    }
    check_options(spec, known)
    attends = _attention_blocks("granitehybrid", spec, 4)
    widths = _ssm_widths("granitehybrid", spec)
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for il in range(spec.n_layers):
        blk = f"blk.{il}"
        tensors += [(f"{blk}.attn_norm.weight", w.norm(e))]
        if attends[il]:
            tensors += _attention(blk, spec, w, qk_norm=False)
        else:
            tensors += _mamba2_block(blk, spec, w, widths)
        tensors += _ffn(blk, spec, w)
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]

    def metadata(writer: Any) -> None:
        _add_hybrid_metadata(writer, spec, attends)
        _add_ssm_metadata(writer, widths)
        residual = float(spec.option("residual_scale", 0.0))
        logit = float(spec.option("logit_scale", 0.0))
        if residual:
            writer.add_residual_scale(residual)
        if logit:
            writer.add_logit_scale(logit)
        if not spec.option("rope", True):
            writer.add_rope_scaling_finetuned(False)

    return tensors, metadata


def mamba2_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Mamba-2: every block a Mamba-2 mixer with a residual, no attention and no feed-forward.

    `n_head`, `n_head_kv` and `n_ff` are not used: the file says 0 heads and no feed-forward, as llama.cpp's
    converter writes Mamba models.

    Options:
        ssm_conv_kernel, ssm_state_size, ssm_head_count, ssm_group_count: as for `granitehybrid_writer`.
    """
    known = {
        "ssm_conv_kernel": Option(int, minimum=2, maximum=16),
        "ssm_state_size": Option(int, minimum=1, maximum=1024),
        "ssm_head_count": Option(int, minimum=1),
        "ssm_group_count": Option(int, minimum=1),
    }
    check_options(spec, known)
    widths = _ssm_widths("mamba2", spec)
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for il in range(spec.n_layers):
        blk = f"blk.{il}"
        tensors += [(f"{blk}.attn_norm.weight", w.norm(e))]
        tensors += _mamba2_block(blk, spec, w, widths)
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]

    def metadata(writer: Any) -> None:
        # As llama.cpp's converter writes Mamba models: no attention, the keys present but 0.
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        _add_ssm_metadata(writer, widths)
        writer.add_layer_norm_rms_eps(1e-5)

    return tensors, metadata


def mamba_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Mamba: every block a Mamba mixer (`build_mamba_layer`) with a residual, no attention, no feed-forward.

    As for `mamba2_writer`, the file says 0 heads and no feed-forward.

    Options:
        ssm_conv_kernel (int): `ssm.conv_kernel` (default 4).
        ssm_state_size (int): `ssm.state_size` (default 16).
        ssm_dt_rank (int): `ssm.time_step_rank`, Δ's rank (default `ceil(n_embd / 16)`).
        dt_b_c_rms (bool): `ssm.dt_b_c_rms`, Falcon-Mamba's norms of Δ, B and C (default False).
    """
    known = {
        "ssm_conv_kernel": Option(int, minimum=2, maximum=16),
        "ssm_state_size": Option(int, minimum=1, maximum=1024),
        "ssm_dt_rank": Option(int, minimum=1),
        "dt_b_c_rms": Option(bool),
    }
    check_options(spec, known)
    e = spec.n_embd
    d_conv, d_inner = int(spec.option("ssm_conv_kernel", 4)), 2 * e
    d_state, dt_rank = int(spec.option("ssm_state_size", 16)), int(spec.option("ssm_dt_rank", -(-e // 16)))
    if d_conv < 2 or d_state < 1 or dt_rank < 1:
        raise ValueError(f"the ssm options of {spec.arch} must be at least 1 (ssm_conv_kernel at least 2).")
    np = w.np
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for il in range(spec.n_layers):
        blk = f"blk.{il}"
        tensors += [
            (f"{blk}.attn_norm.weight", w.norm(e)),
            (f"{blk}.ssm_in.weight", w.matrix(2 * d_inner, e)),
            (f"{blk}.ssm_conv1d.weight", _f32_matrix(w, d_inner, d_conv)),
            (f"{blk}.ssm_conv1d.bias", w.vector(d_inner)),
            (f"{blk}.ssm_x.weight", w.matrix(dt_rank + 2 * d_state, d_inner)),
            (f"{blk}.ssm_dt.weight", w.matrix(d_inner, dt_rank)),
            (f"{blk}.ssm_dt.bias", w.vector(d_inner)),
            # Stored negated (-exp(A_log)) for a decaying state.
            (f"{blk}.ssm_a", -np.exp(w.rng.uniform(0.0, 1.0, size=(d_inner, d_state)).astype(np.float32))),
            (f"{blk}.ssm_d", np.ones(d_inner, dtype=np.float32)),
            (f"{blk}.ssm_out.weight", w.matrix(e, d_inner)),
        ]
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]

    def metadata(writer: Any) -> None:
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
        writer.add_ssm_conv_kernel(d_conv)
        writer.add_ssm_inner_size(d_inner)
        writer.add_ssm_state_size(d_state)
        writer.add_ssm_time_step_rank(dt_rank)
        if spec.option("dt_b_c_rms", False):
            writer.add_ssm_dt_b_c_rms(True)
        writer.add_layer_norm_rms_eps(1e-5)

    return tensors, metadata

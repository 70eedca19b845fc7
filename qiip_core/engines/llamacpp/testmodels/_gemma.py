"""Gemma 2 and Gemma 3 test models: interleaved sliding-window attention, post-norms, a tied output.

The tensors and keys are the ones `src/models/gemma2.cpp` and `gemma3.cpp` load: Q/K/V and output projections
with a head width of their own (`attention.key_length`, usually wider than `n_embd / n_head`), a norm after
attention and after the feed-forward block, GeGLU, and no `output.weight` (the input embedding is reused).
Gemma 3 adds RMS norms on Q and K.

Options:

- `sliding_window` (tokens): Gemma 2 defaults to 4096 when absent; Gemma 3 slides only when it is set.
- `swa_pattern`: of every N layers the last is full attention (`attention.sliding_window_pattern`; llama.cpp's
  defaults are 2 for Gemma 2 and 6 for Gemma 3; 0 makes every layer slide).
- `head_dim`: K and V head width (default `n_embd / n_head`).
- `final_logit_softcapping`, `attn_logit_softcapping`: Gemma 2's soft caps (30 and 50 by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qiip_core.engines.llamacpp.testmodels._generate import Option, Tensors, TestModelSpec, Weights, check_options

__all__ = ["gemma2_writer", "gemma3_writer"]

_HEAD_DIM = Option(int, minimum=8, maximum=512)
_SOFTCAP = Option(float, minimum=1e-3)
_GEMMA2_OPTIONS = {
    "sliding_window": Option(int, minimum=1),
    "swa_pattern": Option(int, minimum=0),
    "head_dim": _HEAD_DIM,
    "final_logit_softcapping": _SOFTCAP,
    "attn_logit_softcapping": _SOFTCAP,
}
_GEMMA3_OPTIONS = {
    "sliding_window": Option(int, minimum=0),
    "swa_pattern": Option(int, minimum=0),
    "head_dim": _HEAD_DIM,
    "final_logit_softcapping": _SOFTCAP,
}


def _check(spec: TestModelSpec, known: dict[str, Option]) -> None:
    check_options(spec, known)
    head_dim = int(spec.option("head_dim", spec.head_dim))
    if head_dim % 2:
        raise ValueError(f"option head_dim of {spec.arch} must be even (RoPE), got {head_dim}.")


def _tensors(spec: TestModelSpec, w: Weights, *, qk_norm: bool) -> Tensors:
    e, hd = spec.n_embd, int(spec.option("head_dim", spec.head_dim))
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += [
            (f"{blk}.attn_norm.weight", w.norm(e)),
            (f"{blk}.attn_q.weight", w.matrix(spec.n_head * hd, e)),
            (f"{blk}.attn_k.weight", w.matrix(spec.n_head_kv * hd, e)),
            (f"{blk}.attn_v.weight", w.matrix(spec.n_head_kv * hd, e)),
        ]
        if qk_norm:
            tensors += [(f"{blk}.attn_q_norm.weight", w.norm(hd)), (f"{blk}.attn_k_norm.weight", w.norm(hd))]
        tensors += [
            (f"{blk}.attn_output.weight", w.matrix(e, spec.n_head * hd)),
            (f"{blk}.post_attention_norm.weight", w.norm(e)),
            (f"{blk}.ffn_norm.weight", w.norm(e)),
            (f"{blk}.ffn_gate.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
            (f"{blk}.post_ffw_norm.weight", w.norm(e)),
        ]
    # No output.weight: Gemma ties the output projection to the input embedding.
    tensors.append(("output_norm.weight", w.norm(e)))
    return tensors


def _metadata(spec: TestModelSpec, writer: Any, *, default_window: int) -> None:
    hd = int(spec.option("head_dim", spec.head_dim))
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    window = int(spec.option("sliding_window", default_window))
    if window:
        writer.add_sliding_window(window)
    if "swa_pattern" in spec.options:
        writer.add_uint32(f"{spec.architecture}.attention.sliding_window_pattern", int(spec.options["swa_pattern"]))


def gemma2_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Gemma 2: every other layer slides by default, attention and final logits are soft-capped."""
    _check(spec, _GEMMA2_OPTIONS)

    def metadata(writer: Any) -> None:
        _metadata(spec, writer, default_window=4096)
        writer.add_attn_logit_softcapping(float(spec.option("attn_logit_softcapping", 50.0)))
        writer.add_final_logit_softcapping(float(spec.option("final_logit_softcapping", 30.0)))

    return _tensors(spec, w, qk_norm=False), metadata


def gemma3_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Gemma 3: Q/K norms; five of every six layers slide when a window is set."""
    _check(spec, _GEMMA3_OPTIONS)

    def metadata(writer: Any) -> None:
        _metadata(spec, writer, default_window=0)
        if "final_logit_softcapping" in spec.options:
            writer.add_final_logit_softcapping(float(spec.options["final_logit_softcapping"]))

    return _tensors(spec, w, qk_norm=True), metadata

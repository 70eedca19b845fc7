"""Test models of the plain decoders: dense `llama` (and Mixtral-style `llama` with experts), and `granite`.

`llama` is the default test model: RMS norms, separate Q/K/V projections, a SwiGLU feed-forward and an untied
output, the tensors `src/models/llama.cpp` loads. With expert options it is a Mixtral-style mixture of experts,
written by `_moe.llama_moe_writer`. `granite` is llama's tensors with a logit scale: an architecture
llama.cpp serves and the planner does not model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from qiip_core.engines.llamacpp.testmodels._generate import (
    Option,
    Tensors,
    TestModelSpec,
    Weights,
    add_attention_metadata,
    check_options,
)
from qiip_core.engines.llamacpp.testmodels._moe import MOE_OPTIONS, llama_moe_writer

__all__ = ["granite_writer", "llama_writer"]


def llama_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """llama: RMS norms, separate Q/K/V projections, SwiGLU feed-forward, an untied output.

    With expert options (`n_expert`, `n_expert_used`, `n_ff_expert`) it is a Mixtral-style mixture of experts,
    written by `_moe.llama_moe_writer`; without, the dense model.
    """
    if spec.options:
        if set(spec.options) & MOE_OPTIONS:
            return llama_moe_writer(spec, w)
        raise ValueError(
            f"{spec.arch} takes only the expert options ({', '.join(sorted(MOE_OPTIONS))}); got "
            f"{', '.join(sorted(spec.options))}."
        )
    e, hd = spec.n_embd, spec.head_dim
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += [
            (f"{blk}.attn_norm.weight", w.norm(e)),
            (f"{blk}.attn_q.weight", w.matrix(spec.n_head * hd, e)),
            (f"{blk}.attn_k.weight", w.matrix(spec.n_head_kv * hd, e)),
            (f"{blk}.attn_v.weight", w.matrix(spec.n_head_kv * hd, e)),
            (f"{blk}.attn_output.weight", w.matrix(e, spec.n_head * hd)),
            (f"{blk}.ffn_norm.weight", w.norm(e)),
            (f"{blk}.ffn_gate.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
        ]
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]
    return tensors, lambda writer: add_attention_metadata(writer, spec)


def granite_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """granite (dense): llama's tensors and a logit scale (`granite.logit_scale`, required by llama.cpp).

    An architecture llama.cpp serves and the planner does not model: it is planned by `llama-fit-params` and its
    caches are recorded as unverified. Options: `logit_scale` (default 8).
    """
    check_options(spec, {"logit_scale": Option(float, minimum=1e-6)})
    scale = float(spec.option("logit_scale", 8.0))
    tensors, llama_metadata = llama_writer(replace(spec, options={}), w)

    def metadata(writer: Any) -> None:
        llama_metadata(writer)
        writer.add_logit_scale(scale)

    return tensors, metadata

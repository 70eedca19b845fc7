"""Test model writers for mixture-of-experts decoders: `qwen3moe`, Mixtral-style `llama` and `qwen2moe`.

In a mixture-of-experts block the dense feed-forward is replaced by `n_expert` smaller ones (the experts) and a
router (`ffn_gate_inp`, `[n_embd, n_expert]`) that picks `n_expert_used` of them per token. llama.cpp stores
each projection of all experts as one 3-D tensor, `ne = [n_in, n_out, n_expert]` (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`), and multiplies by the selected slices with `ggml_mul_mat_id`.

```
architecture  expert width (metadata)                    extras
llama         feed_forward_length (Mixtral: no own key)  -
qwen3moe      expert_feed_forward_length                 RMS norms of Q and K (attn_q_norm, attn_k_norm)
qwen2moe      expert_feed_forward_length                 Q/K/V biases; a shared expert with its own gate
```

Options (`make_test_gguf(..., options=...)`):

- `n_expert` (default 8): experts per block, 2 to 64;
- `n_expert_used` (default 2): experts per token, 1 to `n_expert`;
- `n_ff_expert`: one expert's width; for qwen3moe and qwen2moe it defaults to `n_ff / n_expert_used`
  (rounded up to a multiple of 32, so Q8_0 can store it), for llama it must be `n_ff` (llama.cpp sizes Mixtral's
  experts from `feed_forward_length`);
- `n_ff_shared_expert` (qwen2moe only, default `n_ff`): the shared expert's width.

The `llama` writer (`_llama.llama_writer`) hands over to `llama_moe_writer` when any of these options is
given, and writes the dense model otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qiip_core.engines.llamacpp.testmodels._generate import (
    Option,
    Tensors,
    TestModelSpec,
    Weights,
    add_attention_metadata,
    check_options,
)

__all__ = ["MOE_OPTIONS", "llama_moe_writer", "qwen2moe_writer", "qwen3moe_writer"]

MOE_OPTIONS = frozenset({"n_expert", "n_expert_used", "n_ff_expert"})
"""The options that make a mixture-of-experts model (the `llama` writer delegates when it sees one)."""

MAX_TEST_EXPERTS = 64
"""Most experts a test block has: enough for any routing shape, small enough to write quickly."""


_EXPERT_RULES = {
    "n_expert": Option(int, minimum=2, maximum=MAX_TEST_EXPERTS),
    "n_expert_used": Option(int, minimum=1, maximum=MAX_TEST_EXPERTS),
    "n_ff_expert": Option(int, minimum=1, maximum=16 * 16384),
    "n_ff_shared_expert": Option(int, minimum=1, maximum=16 * 16384),
}


def _check_options(spec: TestModelSpec, allowed: frozenset[str]) -> None:
    check_options(spec, {name: rule for name, rule in _EXPERT_RULES.items() if name in allowed})


def _experts(spec: TestModelSpec, *, default_ff: int) -> tuple[int, int, int]:
    """`(n_expert, n_expert_used, n_ff_expert)` from the options, validated."""
    n_expert = int(spec.option("n_expert", 8))
    used = int(spec.option("n_expert_used", min(2, n_expert)))
    ff = int(spec.option("n_ff_expert", default_ff))
    if not 2 <= n_expert <= MAX_TEST_EXPERTS:
        raise ValueError(f"n_expert must be between 2 and {MAX_TEST_EXPERTS}, got {n_expert}.")
    if not 1 <= used <= n_expert:
        raise ValueError(f"n_expert_used must be between 1 and n_expert ({n_expert}), got {used}.")
    if not 1 <= ff <= 16 * 16384:
        raise ValueError(f"n_ff_expert must be between 1 and {16 * 16384}, got {ff}.")
    return n_expert, used, ff


def _default_expert_ff(spec: TestModelSpec) -> int:
    # llama.cpp's own fallback is n_ff / n_expert_used; round up to whole Q8_0 blocks so a quantised copy loads.
    used = int(spec.option("n_expert_used", min(2, int(spec.option("n_expert", 8)))))
    width = max(1, spec.n_ff // max(1, used))
    return -(-width // 32) * 32


def _expert_tensors(w: Weights, blk: str, e: int, n_expert: int, ff: int) -> Tensors:
    """The router and the three stacked expert projections of one block, in llama.cpp's order."""
    return [
        (f"{blk}.ffn_gate_inp.weight", w.matrix(n_expert, e)),
        (f"{blk}.ffn_gate_exps.weight", w.experts(n_expert, ff, e)),
        (f"{blk}.ffn_down_exps.weight", w.experts(n_expert, e, ff)),
        (f"{blk}.ffn_up_exps.weight", w.experts(n_expert, ff, e)),
    ]


def _attention_tensors(w: Weights, spec: TestModelSpec, blk: str, *, qk_norm: bool, qkv_bias: bool) -> Tensors:
    e, hd = spec.n_embd, spec.head_dim
    tensors: Tensors = [
        (f"{blk}.attn_norm.weight", w.norm(e)),
        (f"{blk}.attn_q.weight", w.matrix(spec.n_head * hd, e)),
        (f"{blk}.attn_k.weight", w.matrix(spec.n_head_kv * hd, e)),
        (f"{blk}.attn_v.weight", w.matrix(spec.n_head_kv * hd, e)),
    ]
    if qkv_bias:
        tensors += [
            (f"{blk}.attn_q.bias", w.vector(spec.n_head * hd)),
            (f"{blk}.attn_k.bias", w.vector(spec.n_head_kv * hd)),
            (f"{blk}.attn_v.bias", w.vector(spec.n_head_kv * hd)),
        ]
    tensors.append((f"{blk}.attn_output.weight", w.matrix(e, spec.n_head * hd)))
    if qk_norm:
        tensors += [(f"{blk}.attn_q_norm.weight", w.norm(hd)), (f"{blk}.attn_k_norm.weight", w.norm(hd))]
    return tensors


def _expert_metadata(
    spec: TestModelSpec, n_expert: int, used: int, ff: int | None, shared_ff: int | None = None
) -> Callable[[Any], None]:
    def add(writer: Any) -> None:
        add_attention_metadata(writer, spec, rms_eps=1e-6)
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(used)
        if ff is not None:
            writer.add_expert_feed_forward_length(ff)
        if shared_ff is not None:
            writer.add_expert_shared_feed_forward_length(shared_ff)

    return add


def llama_moe_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """Mixtral-style llama: llama's attention, every block's feed-forward a mixture of `n_ff`-wide experts.

    llama.cpp reads the expert width of a llama model from `llama.feed_forward_length` (there is no expert
    width key for it), so `n_ff_expert`, when given, must equal `n_ff`.
    """
    _check_options(spec, MOE_OPTIONS)
    n_expert, used, ff = _experts(spec, default_ff=spec.n_ff)
    if ff != spec.n_ff:
        raise ValueError(
            f"a llama model's experts are feed_forward_length ({spec.name('n_ff')} = {spec.n_ff}) wide; pass "
            f"{spec.name('n_ff')}={ff} instead "
            f"of n_ff_expert={ff}."
        )
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += _attention_tensors(w, spec, blk, qk_norm=False, qkv_bias=False)
        tensors.append((f"{blk}.ffn_norm.weight", w.norm(e)))
        tensors += _expert_tensors(w, blk, e, n_expert, ff)
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]

    def add(writer: Any) -> None:
        add_attention_metadata(writer, spec)
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(used)

    return tensors, add


def qwen3moe_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """qwen3moe (Qwen3-30B-A3B style): RMS norms on Q and K per head, a softmax router over experts."""
    _check_options(spec, MOE_OPTIONS)
    n_expert, used, ff = _experts(spec, default_ff=_default_expert_ff(spec))
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += _attention_tensors(w, spec, blk, qk_norm=True, qkv_bias=False)
        tensors.append((f"{blk}.ffn_norm.weight", w.norm(e)))
        tensors += _expert_tensors(w, blk, e, n_expert, ff)
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]
    return tensors, _expert_metadata(spec, n_expert, used, ff)


def qwen2moe_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """qwen2moe (Qwen1.5-MoE style): Q/K/V biases, routed experts and a shared expert behind a sigmoid gate."""
    _check_options(spec, MOE_OPTIONS | {"n_ff_shared_expert"})
    n_expert, used, ff = _experts(spec, default_ff=_default_expert_ff(spec))
    shared = int(spec.option("n_ff_shared_expert", spec.n_ff))
    if not 1 <= shared <= 16 * 16384:
        raise ValueError(f"n_ff_shared_expert must be between 1 and {16 * 16384}, got {shared}.")
    e = spec.n_embd
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += _attention_tensors(w, spec, blk, qk_norm=False, qkv_bias=True)
        tensors.append((f"{blk}.ffn_norm.weight", w.norm(e)))
        tensors += _expert_tensors(w, blk, e, n_expert, ff)
        tensors += [
            (f"{blk}.ffn_gate_inp_shexp.weight", w.vector(e, scale=1.0 / e**0.5)),
            (f"{blk}.ffn_gate_shexp.weight", w.matrix(shared, e)),
            (f"{blk}.ffn_down_shexp.weight", w.matrix(e, shared)),
            (f"{blk}.ffn_up_shexp.weight", w.matrix(shared, e)),
        ]
    tensors += [("output_norm.weight", w.norm(e)), ("output.weight", w.matrix(spec.n_vocab, e))]
    return tensors, _expert_metadata(spec, n_expert, used, ff, shared)

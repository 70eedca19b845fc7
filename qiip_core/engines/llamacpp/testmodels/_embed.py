"""Test models of embedding architectures: BERT-style encoders and a Qwen3-embedding-style decoder.

Embedding models reach llama-server only with `--embeddings`, and their memory differs from a generative
decoder's in ways the planner must model: an encoder (`bert`, `nomic-bert`) has no K/V cache at all
(`llama_model::create_memory` returns none for it) and attends over the micro-batch both ways, while a
Qwen3-embedding model is an ordinary causal decoder with a K/V cache whose GGUF declares its own pooling
(`qwen3.pooling_type` = last). These writers make small random-weight models of each, with the tensors and
keys llama.cpp's loaders require (`src/models/bert.cpp`, `nomic-bert.cpp`, `qwen3.cpp`):

```
bert        token, token-type and absolute position embeddings, an embedding layer norm; per block separate
            (or fused) Q/K/V with biases, attention output with bias and layer norm, GELU feed-forward with
            biases and layer norm (post-norm); no output head. Options: pooling_type, fused_qkv,
            token_types.
nomic-bert  token and token-type embeddings, an embedding layer norm; per block fused QKV without biases,
            rotary positions, SwiGLU feed-forward, post-norm layer norms; no output head. Options: pooling_type.
qwen3       llama's blocks plus RMS norms of every Q and K head (`attn_q_norm`, `attn_k_norm`), an output
            head (tied to the embedding by default, as Qwen3-Embedding-0.6B has it). Options:
            pooling_type, tied_output.
```

The encoders declare llama.cpp's WordPiece tokenizer (`tokenizer.ggml.model` = `bert`) over the shared
vocabulary: its pieces already mark word starts with `▁`, which is what the WordPiece session matches
(`llm_tokenizer_wpm_session`), `</s>` serves as the separator it appends (`add_sep`), and the byte-fallback
pieces are written as ordinary tokens (WordPiece has no byte fallback).
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
    build_vocab,
    check_options,
)

__all__ = ["POOLING_TYPES", "bert_writer", "nomic_bert_writer", "qwen3_writer", "wordpiece_token_types"]

POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last"}
"""`<arch>.pooling_type` values the writers take (`enum llama_pooling_type` in llama.h; rank, 4, needs a
classifier head they do not write)."""

_LAYER_NORM_EPS = 1e-12
"""`attention.layer_norm_epsilon` of BERT checkpoints."""

_SEP_TOKEN_ID = 2
"""`</s>` of the shared vocabulary: the separator WordPiece appends after every input."""


def _pooling(spec: TestModelSpec, default: int) -> int:
    value = spec.option("pooling_type", default)
    if value not in POOLING_TYPES:
        codes = ", ".join(f"{code} ({name})" for code, name in POOLING_TYPES.items())
        raise ValueError(f"option pooling_type must be one of {codes}; got {value!r}.")
    return int(value)


def _add_pooling(writer: Any, code: int) -> None:
    from gguf import PoolingType

    writer.add_pooling_type(PoolingType(code))


def _encoder_metadata(writer: Any, spec: TestModelSpec, *, pooling: int, token_types: int) -> None:
    """The keys a BERT-style encoder has: layer-norm epsilon, non-causal attention, pooling, WordPiece."""
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_eps(_LAYER_NORM_EPS)
    writer.add_causal_attention(False)
    _add_pooling(writer, pooling)
    # llama_model_bert::load_arch_tensors refuses a model without token types.
    writer.add_token_type_count(token_types)
    # make_test_gguf writes the shared SentencePiece keys only where the architecture set none.
    writer.add_tokenizer_model("bert")
    writer.add_token_types(wordpiece_token_types(spec.n_vocab))
    writer.add_sep_token_id(_SEP_TOKEN_ID)
    writer.add_add_sep_token(True)


def wordpiece_token_types(n_vocab: int) -> list[int]:
    """The shared vocabulary's token types for WordPiece: its byte tokens become ordinary pieces.

    llama.cpp's WordPiece vocabulary has no byte fallback; it aborts on a byte token when it builds its piece
    cache (`llama_vocab::impl::token_to_byte`), so the `<0xNN>` pieces are written as normal tokens.

    Args:
        n_vocab: vocabulary size.

    Returns:
        One `gguf.TokenType` value per token.
    """
    from gguf import TokenType

    _, _, types = build_vocab(n_vocab)
    return [int(TokenType.NORMAL) if t == TokenType.BYTE else t for t in types]


def bert_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """bert: absolute positions, token types, post-norm blocks with biases and a GELU feed-forward.

    Options:
        pooling_type: `bert.pooling_type`: 1 (mean, as MiniLM), 2 (cls, the default, as bge) or 3 (last).
        fused_qkv: one `attn_qkv` weight and bias instead of separate Q, K, V (default False).
        token_types: rows of `token_types.weight` (default 2, "Sentence A" and "B").

    Raises:
        ValueError: an unknown option or value.
    """
    check_options(
        spec, {"pooling_type": Option(int, minimum=0), "fused_qkv": Option(bool), "token_types": Option(int, minimum=1)}
    )
    pooling = _pooling(spec, 2)
    token_types = int(spec.option("token_types", 2))
    if token_types < 1:
        raise ValueError(f"option token_types must be at least 1, got {token_types}.")
    e, kv = spec.n_embd, spec.n_head_kv * spec.head_dim
    tensors: Tensors = [
        ("token_embd.weight", w.matrix(spec.n_vocab, e)),
        # F32, as the converter writes it: the graph adds one row to F32 activations, which F16 cannot be.
        ("token_types.weight", w.matrix(token_types, e).astype("float32")),
        ("position_embd.weight", w.matrix(spec.n_ctx_train, e)),
        ("token_embd_norm.weight", w.norm(e)),
        ("token_embd_norm.bias", w.vector(e)),
    ]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        if spec.option("fused_qkv", False):
            tensors += [
                (f"{blk}.attn_qkv.weight", w.matrix(e + 2 * kv, e)),
                (f"{blk}.attn_qkv.bias", w.vector(e + 2 * kv)),
            ]
        else:
            tensors += [
                (f"{blk}.attn_q.weight", w.matrix(e, e)),
                (f"{blk}.attn_q.bias", w.vector(e)),
                (f"{blk}.attn_k.weight", w.matrix(kv, e)),
                (f"{blk}.attn_k.bias", w.vector(kv)),
                (f"{blk}.attn_v.weight", w.matrix(kv, e)),
                (f"{blk}.attn_v.bias", w.vector(kv)),
            ]
        tensors += [
            (f"{blk}.attn_output.weight", w.matrix(e, e)),
            (f"{blk}.attn_output.bias", w.vector(e)),
            (f"{blk}.attn_output_norm.weight", w.norm(e)),
            (f"{blk}.attn_output_norm.bias", w.vector(e)),
            (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_up.bias", w.vector(spec.n_ff)),
            (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
            (f"{blk}.ffn_down.bias", w.vector(e)),
            (f"{blk}.layer_output_norm.weight", w.norm(e)),
            (f"{blk}.layer_output_norm.bias", w.vector(e)),
        ]
    return tensors, lambda writer: _encoder_metadata(writer, spec, pooling=pooling, token_types=token_types)


def nomic_bert_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """nomic-bert: rotary positions, fused QKV without biases, a SwiGLU feed-forward, post-norm blocks.

    Options:
        pooling_type: `nomic-bert.pooling_type`: 1 (mean, the default, as nomic-embed-text), 2 (cls) or 3
            (last).

    Raises:
        ValueError: an unknown option or value.
    """
    check_options(spec, {"pooling_type": Option(int, minimum=0)})
    pooling = _pooling(spec, 1)
    e, kv = spec.n_embd, spec.n_head_kv * spec.head_dim
    tensors: Tensors = [
        ("token_embd.weight", w.matrix(spec.n_vocab, e)),
        ("token_types.weight", w.matrix(2, e).astype("float32")),
        ("token_embd_norm.weight", w.norm(e)),
        ("token_embd_norm.bias", w.vector(e)),
    ]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += [
            (f"{blk}.attn_qkv.weight", w.matrix(e + 2 * kv, e)),
            (f"{blk}.attn_output.weight", w.matrix(e, e)),
            (f"{blk}.attn_output_norm.weight", w.norm(e)),
            (f"{blk}.attn_output_norm.bias", w.vector(e)),
            (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_gate.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
            (f"{blk}.layer_output_norm.weight", w.norm(e)),
            (f"{blk}.layer_output_norm.bias", w.vector(e)),
        ]

    def metadata(writer: Any) -> None:
        _encoder_metadata(writer, spec, pooling=pooling, token_types=2)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_rope_freq_base(1000.0)

    return tensors, metadata


def qwen3_writer(spec: TestModelSpec, w: Weights) -> tuple[Tensors, Callable[[Any], None]]:
    """qwen3: llama's blocks with per-head Q and K RMS norms; as an embedding model, its own pooling.

    Options:
        pooling_type: `qwen3.pooling_type`: 3 (last, the default, as Qwen3-Embedding), 1 (mean), 2 (cls), or
            0 for a generative model (no key written).
        tied_output: the output head reuses `token_embd.weight` (default True, as Qwen3-Embedding-0.6B).

    Raises:
        ValueError: an unknown option or value.
    """
    check_options(spec, {"pooling_type": Option(int, minimum=0), "tied_output": Option(bool)})
    pooling = _pooling(spec, 3)
    e, hd = spec.n_embd, spec.head_dim
    tensors: Tensors = [("token_embd.weight", w.matrix(spec.n_vocab, e))]
    for i in range(spec.n_layers):
        blk = f"blk.{i}"
        tensors += [
            (f"{blk}.attn_norm.weight", w.norm(e)),
            (f"{blk}.attn_q.weight", w.matrix(spec.n_head * hd, e)),
            (f"{blk}.attn_k.weight", w.matrix(spec.n_head_kv * hd, e)),
            (f"{blk}.attn_v.weight", w.matrix(spec.n_head_kv * hd, e)),
            (f"{blk}.attn_q_norm.weight", w.norm(hd)),
            (f"{blk}.attn_k_norm.weight", w.norm(hd)),
            (f"{blk}.attn_output.weight", w.matrix(e, spec.n_head * hd)),
            (f"{blk}.ffn_norm.weight", w.norm(e)),
            (f"{blk}.ffn_gate.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_up.weight", w.matrix(spec.n_ff, e)),
            (f"{blk}.ffn_down.weight", w.matrix(e, spec.n_ff)),
        ]
    tensors.append(("output_norm.weight", w.norm(e)))
    if not spec.option("tied_output", True):
        tensors.append(("output.weight", w.matrix(spec.n_vocab, e)))

    def metadata(writer: Any) -> None:
        add_attention_metadata(writer, spec, rms_eps=1e-6)
        if pooling:
            _add_pooling(writer, pooling)

    return tensors, metadata

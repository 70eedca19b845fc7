from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGUFReader, TokenType

from qiip_core.engines.llamacpp import LaunchSpec, make_test_gguf, read_gguf_metadata
from qiip_core.engines.llamacpp.testmodels._generate import TEST_ARCHITECTURES
from qiip_core.planner import ModelShape


def _write(tmp_path: Path, architecture: str, **options: int | bool) -> Path:
    return make_test_gguf(
        tmp_path / f"{architecture}.gguf",
        architecture=architecture,
        n_layers=2,
        n_embd=64,
        n_head=4,
        n_head_kv=4 if architecture != "qwen3" else 2,
        n_ctx_train=512,
        n_vocab=400,
        n_ff=128,
        options=options,
    )[0]


def test_the_embedding_architectures_are_registered():
    assert {"bert", "nomic-bert", "qwen3"} <= set(TEST_ARCHITECTURES)


@pytest.mark.parametrize(
    ("architecture", "options", "pooling", "fused"),
    [
        ("bert", {}, "cls", False),
        ("bert", {"fused_qkv": True, "pooling_type": 1}, "mean", True),
        ("nomic-bert", {}, "mean", True),
        ("nomic-bert", {"pooling_type": 3}, "last", True),
    ],
)
def test_encoders_are_non_causal_memoryless_wordpiece_models(tmp_path, architecture, options, pooling, fused):
    path = _write(tmp_path, architecture, **options)
    shape = ModelShape.from_metadata(read_gguf_metadata(path))
    assert shape.architecture == architecture and shape.memory == "none" and not shape.causal
    assert shape.pooling == pooling and shape.fused_qkv == fused
    reader = GGUFReader(path)
    assert reader.get_field("tokenizer.ggml.model").contents() == "bert"
    assert reader.get_field("tokenizer.ggml.token_type_count").contents() == 2
    # WordPiece has no byte fallback: llama.cpp aborts loading a byte token into it.
    assert TokenType.BYTE not in reader.get_field("tokenizer.ggml.token_type").contents()
    names = {t.name for t in reader.tensors}
    assert "output.weight" not in names and "output_norm.weight" not in names
    assert ("position_embd.weight" in names) == (architecture == "bert")
    assert ("blk.0.attn_q.bias" in names) == (architecture == "bert" and not fused)
    # Token types are added to F32 activations, so they are F32 like every norm and bias.
    assert reader.get_tensor([t.name for t in reader.tensors].index("token_types.weight")).data.dtype == "float32"


def test_qwen3_is_a_causal_decoder_with_qk_norms_and_its_own_pooling(tmp_path):
    shape = ModelShape.from_metadata(read_gguf_metadata(_write(tmp_path, "qwen3")))
    assert shape.memory == "kv" and shape.causal and shape.pooling == "last" and shape.tied_output
    names = {t.name for t in GGUFReader(tmp_path / "qwen3.gguf").tensors}
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    generative = ModelShape.from_metadata(
        read_gguf_metadata(_write(tmp_path / "g", "qwen3", pooling_type=0, tied_output=False))
    )
    assert generative.pooling == "none" and not generative.tied_output
    assert generative.embeddings_pooling == "mean" and shape.embeddings_pooling == "last"


@pytest.mark.parametrize(
    ("architecture", "options", "message"),
    [
        ("bert", {"sliding_window": 4}, "takes fused_qkv, pooling_type, token_types; got sliding_window"),
        ("nomic-bert", {"fused_qkv": True}, "takes pooling_type; got fused_qkv"),
        ("qwen3", {"n_expert": 8}, "takes pooling_type, tied_output; got n_expert"),
        ("bert", {"pooling_type": 4}, "pooling_type must be one of"),
        ("bert", {"pooling_type": True}, "must be a whole number, got True"),
        ("bert", {"fused_qkv": 1}, "must be true or false, got 1"),
        ("bert", {"token_types": 0}, "token_types of architecture bert must be at least 1"),
    ],
)
def test_unknown_or_invalid_options_are_refused_by_name(tmp_path, architecture, options, message):
    with pytest.raises(ValueError, match=message):
        _write(tmp_path, architecture, **options)


def test_the_llama_vocabulary_is_unchanged_by_the_override_hook(tmp_path):
    reader = GGUFReader(_write(tmp_path, "llama"))
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"
    assert TokenType.BYTE in reader.get_field("tokenizer.ggml.token_type").contents()


def test_launch_pools_as_asked_and_spells_out_the_micro_batch():
    spec = LaunchSpec(model=Path("/m/x.gguf"), alias="x", port=8081, ctx_size=4096, embeddings=True)
    argv = spec.argv(Path("llama-server"))
    # The default is unchanged: mean pooling, llama-server's own batch sizes.
    assert argv[argv.index("--embeddings") + 1 :][:2] == ["--pooling", "mean"] and "--ubatch-size" not in argv
    argv = replace(spec, pooling="last", ubatch_size=510).argv(Path("llama-server"))
    assert argv[argv.index("--pooling") + 1] == "last"
    assert argv[argv.index("--batch-size") + 1] == argv[argv.index("--ubatch-size") + 1] == "510"
    with pytest.raises(ValueError, match="pooling must be one of"):
        replace(spec, pooling="max")
    with pytest.raises(ValueError, match="ubatch_size must be None"):
        replace(spec, ubatch_size=0)

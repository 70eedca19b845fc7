from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter, TokenType

from qiip_core.engines.llamacpp import make_test_gguf, read_gguf_metadata
from qiip_core.engines.llamacpp.testmodels._generate import CHAT_TEMPLATE, MIN_VOCAB, build_vocab


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    ("layers", "embd", "heads", "kv_heads", "ctx", "vocab", "ff"),
    [
        (2, 64, 4, 4, 2048, 512, None),
        (1, 32, 1, 1, 128, 300, 48),
        (4, 128, 4, 2, 4096, 1000, None),
        (3, 256, 8, 1, 32768, 2048, 512),
    ],
)
def test_metadata_round_trip(tmp_path, layers, embd, heads, kv_heads, ctx, vocab, ff):
    [path] = make_test_gguf(
        tmp_path / "m.gguf",
        n_layers=layers,
        n_embd=embd,
        n_head=heads,
        n_head_kv=kv_heads,
        n_ctx_train=ctx,
        n_vocab=vocab,
        n_ff=ff,
    )
    meta = read_gguf_metadata(path)
    assert meta.architecture == "llama"
    assert (meta.n_layers, meta.n_embd, meta.n_head, meta.n_head_kv) == (layers, embd, heads, kv_heads)
    assert (meta.n_ctx_train, meta.n_vocab) == (ctx, vocab)
    assert meta.head_dim_k == meta.head_dim_v == embd // heads
    assert meta.paths == (path,)
    n_ff = ff or 4 * embd
    head = embd // heads
    matrices = 2 * vocab * embd + layers * (embd * heads * head * 2 + embd * kv_heads * head * 2 + 3 * embd * n_ff)
    norms = (2 * layers + 1) * embd
    assert meta.tensor_bytes == 2 * matrices + 4 * norms  # F16 matrices, F32 norms


def test_vocabulary_chat_template_and_special_ids(tiny_gguf):
    reader = GGUFReader(tiny_gguf)
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert types[:3] == [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    assert set(types[3:259]) == {TokenType.BYTE}
    assert "\u2581the" in tokens and "\u2581hello" in tokens
    assert len(set(tokens)) == len(tokens) == 512
    assert reader.get_field("tokenizer.ggml.model").contents() == "llama"
    assert len(reader.get_field("tokenizer.ggml.scores").contents()) == 512
    assert reader.get_field("tokenizer.ggml.bos_token_id").contents() == 1
    assert reader.get_field("tokenizer.ggml.eos_token_id").contents() == 2
    assert reader.get_field("tokenizer.ggml.unknown_token_id").contents() == 0
    assert reader.get_field("tokenizer.chat_template").contents() == CHAT_TEMPLATE


def test_word_pieces_have_every_prefix_so_merges_reach_whole_words():
    tokens, scores, types = build_vocab(MIN_VOCAB)
    vocab = set(tokens)
    for token in tokens[259:]:
        if token.startswith("\u2581") and len(token) > 2:
            assert token[:-1] in vocab, token
    assert len(tokens) == len(scores) == len(types) == MIN_VOCAB


def test_large_vocabulary_is_filled_with_unique_pieces():
    tokens, _, _ = build_vocab(40_000)
    assert len(tokens) == len(set(tokens)) == 40_000


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    [a] = make_test_gguf(tmp_path / "a.gguf", seed=7)
    [b] = make_test_gguf(tmp_path / "b.gguf", seed=7)
    [c] = make_test_gguf(tmp_path / "c.gguf", seed=8)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(c)


@pytest.mark.parametrize("split", [2, 3, 5, 21])
def test_split_family(tmp_path, split):
    paths = make_test_gguf(tmp_path / "fam.gguf", split=split)  # 2 layers: 21 tensors
    assert [p.name for p in paths] == [f"fam-{i:05d}-of-{split:05d}.gguf" for i in range(1, split + 1)]
    assert sorted(tmp_path.iterdir()) == paths  # nothing else left behind
    for number, path in enumerate(paths):
        reader = GGUFReader(path)
        assert reader.get_field("split.no").contents() == number
        assert reader.get_field("split.count").contents() == split
        assert reader.get_field("split.tensors.count").contents() == 21
        assert len(reader.tensors) >= 1
    whole = read_gguf_metadata(make_test_gguf(tmp_path / "one" / "fam.gguf")[0])
    meta = read_gguf_metadata(paths[0])
    assert meta.paths == tuple(paths)
    assert meta.tensor_bytes == whole.tensor_bytes
    assert meta.n_layers == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_embd": 64, "n_head": 3}, "must be at least 1 and divide n_embd"),
        ({"n_embd": 64, "n_head": 64}, "must be even"),
        ({"n_head": 4, "n_head_kv": 3}, "n_head_kv must be at least 1 and divide n_head"),
        ({"n_vocab": 299}, "n_vocab must be between 300"),
        ({"n_layers": 0}, "n_layers must be between 1"),
        ({"n_ctx_train": 8}, "n_ctx_train must be between 16"),
        ({"split": 22}, r"split must be between 1 and the number of tensors \(21"),
        ({"split": 0}, "split must be between 1"),
        ({"n_ff": 0}, "n_ff must be between 1"),
        ({"architecture": "gpt-9"}, "architecture must be one of .*llama"),
        ({"options": {"sliding_window": 4}}, r"architecture llama takes only the expert options \(.*\); got sliding"),
    ],
)
def test_invalid_shapes_are_refused_with_what_is_allowed(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_test_gguf(tmp_path / "m.gguf", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_path_must_end_in_gguf(tmp_path):
    with pytest.raises(ValueError, match=r"ending in \.gguf"):
        make_test_gguf(tmp_path / "model.bin")


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "m.gguf"
    target.write_bytes(b"previous")

    def fail(self, *, progress=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="No space left"):
        make_test_gguf(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    assert target.read_bytes() == b"previous"


@pytest.mark.parametrize(
    ("architecture", "options", "message"),
    [
        ("gemma3", {"sliding_window": -5}, "sliding_window of architecture gemma3 must be at least 0, got -5"),
        ("gemma3", {"head_dim": 0}, "head_dim of architecture gemma3 must be at least 8"),
        ("gemma3", {"head_dim": 9}, "head_dim of architecture gemma3 must be even"),
        ("gemma2", {"sliding_window": 0}, "sliding_window of architecture gemma2 must be at least 1"),
        ("qwen3moe", {"n_expert": 1.5}, "n_expert of architecture qwen3moe must be a whole number, got 1.5"),
        ("qwen3moe", {"n_expert": True}, "n_expert of architecture qwen3moe must be a whole number, got True"),
        ("granite", {"logit_scale": 0}, "logit_scale of architecture granite must be at least"),
        ("lfm2", {"attention_period": 1}, "attention_period of architecture lfm2 must be at least 2"),
        ("lfm2", {"attention_period": 3}, "between 2 and the layer count \\(2\\)"),
    ],
)
def test_option_values_are_checked_before_anything_is_written(tmp_path, architecture, options, message):
    with pytest.raises(ValueError, match=message):
        make_test_gguf(tmp_path / "m.gguf", architecture=architecture, n_embd=128, options=options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("architecture", ["lfm2", "granitehybrid"])
def test_a_small_hybrid_has_both_kinds_of_block_by_default(tmp_path, architecture):
    from qiip_core.planner import ModelShape

    path = make_test_gguf(tmp_path / "h.gguf", architecture=architecture, n_layers=2, n_embd=128)[0]
    shape = ModelShape.from_metadata(read_gguf_metadata(path))
    assert shape.recurrent_layers == (True, False)

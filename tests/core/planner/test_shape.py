from __future__ import annotations

import pytest

from qiip_core.engines.llamacpp import make_test_gguf, read_gguf_metadata
from qiip_core.planner import ModelShape
from qiip_core.planner._shape import row_bytes

from .conftest import shape


def test_from_metadata_reads_every_field_of_a_generated_model(tmp_path):
    paths = make_test_gguf(
        tmp_path / "m.gguf", n_layers=3, n_embd=128, n_head=4, n_head_kv=2, n_ctx_train=4096, n_vocab=600, n_ff=320
    )
    metadata = read_gguf_metadata(paths[0])
    s = ModelShape.from_metadata(metadata)
    assert (s.architecture, s.n_layers, s.n_embd, s.n_head, s.n_head_kv) == ("llama", 3, 128, 4, 2)
    assert (s.head_dim_k, s.head_dim_v, s.n_ff, s.n_ctx_train, s.n_vocab) == (32, 32, 320, 4096, 600)
    assert s.weights_bytes == metadata.tensor_bytes
    # F16 matrices, F32 norms: q (128x128), k and v (128x64), o (128x128), gate/up/down (128x320), two norms.
    block = 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 320 * 3) + 2 * 128 * 4
    assert s.block_bytes == (block,) * 3
    assert s.token_embd_bytes == 600 * 128 * 2
    assert not s.tied_output
    assert s.output_bytes() == 600 * 128 * 2 + 128 * 4
    assert s.total_layers == 4


def test_a_split_family_counts_blocks_across_shards(tmp_path):
    paths = make_test_gguf(tmp_path / "s.gguf", n_layers=2, split=3)
    whole = make_test_gguf(tmp_path / "w.gguf", n_layers=2)
    split, single = read_gguf_metadata(paths[0]), read_gguf_metadata(whole[0])
    assert split.block_tensor_bytes == single.block_tensor_bytes and split.n_ff == single.n_ff == 256


def test_without_block_sizes_the_layers_share_the_rest_evenly():
    s = ModelShape(
        architecture="llama",
        n_layers=4,
        n_embd=64,
        n_head=4,
        n_head_kv=4,
        head_dim_k=16,
        head_dim_v=16,
        n_ff=256,
        n_ctx_train=2048,
        n_vocab=512,
        weights_bytes=1000 + 2 * 100,
        token_embd_bytes=100,
    )
    # Unknown output: as large as the embedding.
    assert s.output_bytes() == 100
    assert s.layer_bytes() == (250, 250, 250, 250)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_layers": 0}, "n_layers must be at least 1"),
        ({"n_ctx_train": 0}, "n_ctx_train must be at least 1"),
        ({"block_bytes": (1, 2)}, "block_bytes has 2 entries for 4 blocks"),
        ({"token_embd_bytes": 10**9}, "weights_bytes must cover"),
    ],
)
def test_inconsistent_shapes_are_refused(change, message):
    fields = {
        "architecture": "llama",
        "n_layers": 4,
        "n_embd": 256,
        "n_head": 4,
        "n_head_kv": 2,
        "head_dim_k": 64,
        "head_dim_v": 64,
        "n_ff": 1024,
        "n_ctx_train": 8192,
        "n_vocab": 2000,
        "weights_bytes": 1000,
    } | change
    with pytest.raises(ValueError, match=message):
        ModelShape(**fields)


def test_row_bytes_follows_ggml():
    assert row_bytes("f16", 100) == 200
    assert row_bytes("q8_0", 64) == 68
    assert row_bytes("i64", 3) == 24
    with pytest.raises(ValueError, match="whole blocks of 32"):
        row_bytes("q8_0", 48)
    with pytest.raises(ValueError, match="unknown ggml type"):
        row_bytes("q4_k", 256)


def test_cache_type_support_depends_on_head_widths():
    assert shape().supports_cache_type("q8_0")
    assert not shape(n_embd=64, n_head=4).supports_cache_type("q8_0")
    assert shape(n_embd=64, n_head=4).supports_cache_type("f16")

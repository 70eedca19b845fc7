from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from qiip_core.engines.llamacpp import TEST_ARCHITECTURES, GgufTensor, make_test_gguf, read_gguf_metadata
from qiip_core.planner import ModelShape


def _tensors(path: Path) -> dict[str, GgufTensor]:
    return {t.name: t for t in read_gguf_metadata(path).tensors}


def test_expert_architectures_are_registered():
    assert {"llama", "qwen2moe", "qwen3moe"} <= set(TEST_ARCHITECTURES)


def test_qwen3moe_writes_stacked_experts_a_router_and_qk_norms(tmp_path):
    [path] = make_test_gguf(
        tmp_path / "q3.gguf",
        architecture="qwen3moe",
        n_layers=2,
        n_embd=128,
        n_head=4,
        n_head_kv=2,
        n_ff=512,
        options={"n_expert": 8, "n_expert_used": 2, "n_ff_expert": 96},
    )
    meta = read_gguf_metadata(path)
    assert meta.architecture == "qwen3moe"
    assert meta.value("{arch}.expert_count") == 8 and meta.value("{arch}.expert_used_count") == 2
    assert meta.value("{arch}.expert_feed_forward_length") == 96
    tensors = _tensors(path)
    assert tensors["blk.1.ffn_gate_inp.weight"].ne == (128, 8)
    assert tensors["blk.1.ffn_gate_exps.weight"].ne == (128, 96, 8)
    assert tensors["blk.1.ffn_up_exps.weight"].ne == (128, 96, 8)
    assert tensors["blk.1.ffn_down_exps.weight"].ne == (96, 128, 8)
    assert tensors["blk.0.attn_q_norm.weight"].ne == tensors["blk.0.attn_k_norm.weight"].ne == (32,)
    assert tensors["blk.0.ffn_up_exps.weight"].n_bytes == 8 * 96 * 128 * 2
    assert not any(".ffn_up.weight" in name for name in tensors)
    shape = ModelShape.from_metadata(meta)
    assert (shape.n_expert, shape.n_expert_used, shape.n_ff_expert) == (8, 2, 96)
    # The blocks carry their experts (what GPU mode puts on each block's device).
    assert shape.block_bytes[0] > 3 * 8 * 96 * 128 * 2


def test_qwen_expert_width_defaults_to_n_ff_per_used_expert_in_whole_q8_0_blocks(tmp_path):
    [path] = make_test_gguf(
        tmp_path / "q3.gguf", architecture="qwen3moe", n_ff=500, options={"n_expert": 4, "n_expert_used": 3}
    )
    assert read_gguf_metadata(path).value("{arch}.expert_feed_forward_length") == 192  # ceil32(500 // 3)


def test_llama_with_expert_options_is_mixtral_style_and_without_them_dense(tmp_path):
    [moe] = make_test_gguf(tmp_path / "moe.gguf", n_ff=256, options={"n_expert": 4, "n_expert_used": 2})
    [dense] = make_test_gguf(tmp_path / "dense.gguf", n_ff=256)
    meta = read_gguf_metadata(moe)
    assert meta.architecture == "llama" and meta.value("{arch}.expert_count") == 4
    assert meta.value("{arch}.expert_feed_forward_length") is None  # Mixtral's experts are feed_forward_length wide
    moe_tensors, dense_tensors = _tensors(moe), _tensors(dense)
    assert moe_tensors["blk.0.ffn_up_exps.weight"].ne == (64, 256, 4)
    assert "blk.0.ffn_up.weight" not in moe_tensors and "blk.0.ffn_up_exps.weight" not in dense_tensors
    assert read_gguf_metadata(dense).value("{arch}.expert_count") is None
    # n_ff_expert equal to n_ff is accepted, and is the same model.
    [same] = make_test_gguf(tmp_path / "same.gguf", n_ff=256, options={"n_expert": 4, "n_ff_expert": 256})
    assert hashlib.sha256(same.read_bytes()).digest() == hashlib.sha256(moe.read_bytes()).digest()


def test_qwen2moe_has_biases_and_a_shared_expert(tmp_path):
    [path] = make_test_gguf(
        tmp_path / "q2.gguf",
        architecture="qwen2moe",
        n_embd=64,
        options={"n_expert": 4, "n_expert_used": 2, "n_ff_expert": 64, "n_ff_shared_expert": 160},
    )
    meta = read_gguf_metadata(path)
    tensors = _tensors(path)
    assert meta.value("{arch}.expert_shared_feed_forward_length") == 160
    assert tensors["blk.0.attn_q.bias"].ne == (64,) and tensors["blk.0.ffn_gate_inp_shexp.weight"].ne == (64,)
    assert tensors["blk.0.ffn_up_shexp.weight"].ne == (64, 160)
    assert ModelShape.from_metadata(meta).n_ff_shared_expert == 160


def test_same_seed_same_bytes(tmp_path):
    options = {"n_expert": 4, "n_expert_used": 2}
    [a] = make_test_gguf(tmp_path / "a.gguf", architecture="qwen3moe", seed=3, options=options)
    [b] = make_test_gguf(tmp_path / "b.gguf", architecture="qwen3moe", seed=3, options=options)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(
    ("architecture", "options", "message"),
    [
        ("qwen3moe", {"n_expert": 1}, "option n_expert of architecture qwen3moe must be at least 2, got 1"),
        ("qwen3moe", {"n_expert": 65}, "n_expert of architecture qwen3moe must be at most 64, got 65"),
        ("qwen3moe", {"n_expert": 4, "n_expert_used": 5}, r"n_expert_used must be between 1 and n_expert \(4\)"),
        ("qwen3moe", {"n_ff_expert": 0}, "n_ff_expert of architecture qwen3moe must be at least 1"),
        ("qwen3moe", {"n_ff_shared_expert": 64}, "takes n_expert, .*; got n_ff_shared_expert"),
        ("qwen2moe", {"n_ff_shared_expert": 0}, "n_ff_shared_expert of architecture qwen2moe must be at least 1"),
        ("llama", {"n_expert": 4, "n_ff_expert": 128}, r"feed_forward_length \(n_ff = 256\) wide; pass n_ff=128"),
        ("llama", {"n_expert": 4, "sliding_window": 8}, "takes n_expert, .*; got sliding_window"),
    ],
)
def test_invalid_expert_options_are_refused(tmp_path, architecture, options, message):
    with pytest.raises(ValueError, match=message):
        make_test_gguf(tmp_path / "m.gguf", architecture=architecture, options=options)
    assert list(tmp_path.iterdir()) == []

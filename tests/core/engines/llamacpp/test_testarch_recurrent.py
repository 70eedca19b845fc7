"""The recurrent and hybrid test-model writers: tensors and keys as llama.cpp loads them, and the shapes read back."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from qiip_core.engines.llamacpp import (
    TEST_ARCHITECTURES,
    GgufMetadata,
    GgufTensor,
    make_test_gguf,
    read_gguf_metadata,
)
from qiip_core.planner import ModelShape
from qiip_core.planner._shape import SsmShape


def write(
    tmp_path: Path, architecture: str, options: Mapping[str, int | float | bool] | None = None, **kwargs: int
) -> tuple[GgufMetadata, ModelShape, dict[str, GgufTensor]]:
    args: dict[str, Any] = {
        "n_layers": 4,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 2,
        "n_vocab": 300,
        "n_ff": 96,
    } | kwargs
    [path] = make_test_gguf(tmp_path / f"{architecture}.gguf", architecture=architecture, options=options, **args)
    meta = read_gguf_metadata(path)
    return meta, ModelShape.from_metadata(meta), {t.name: t for t in meta.tensors}


def test_every_recurrent_architecture_is_written():
    assert {"lfm2", "granitehybrid", "mamba2", "mamba"} <= set(TEST_ARCHITECTURES)


def test_lfm2_marks_its_convolution_blocks_with_zero_kv_heads(tmp_path):
    meta, shape, tensors = write(tmp_path, "lfm2", {"attention_period": 2, "l_cache": 4})
    assert meta.value("lfm2.attention.head_count_kv") == [0, 2, 0, 2]
    assert meta.value("lfm2.shortconv.l_cache") == 4
    assert shape.memory == "hybrid" and shape.recurrent_layers == (True, False, True, False)
    assert shape.attention_layers() == (1, 3) and shape.shortconv_cache == 4
    # The convolution kernel is F32 ([l_cache, n_embd]); projections F16; the output norm under LFM2's name.
    conv = tensors["blk.0.shortconv.conv.weight"]
    assert (conv.ggml_type, conv.ne) == ("F32", (4, 64))
    assert tensors["blk.0.shortconv.in_proj.weight"].ne == (64, 192)
    assert "blk.0.attn_q.weight" not in tensors and "blk.1.attn_q_norm.weight" in tensors
    assert "token_embd_norm.weight" in tensors and "output.weight" in tensors


def test_lfm2_options_tie_the_output_and_slide_the_attention(tmp_path):
    _, shape, tensors = write(tmp_path, "lfm2", {"tied_output": True, "sliding_window": 128})
    assert "output.weight" not in tensors and shape.tied_output
    # The default period of 3 over 4 blocks: block 2 attends, through the window.
    assert shape.memory == "hybrid_iswa" and shape.swa_window == 128
    assert shape.swa_layers == (False, False, True, False)


def test_granite_hybrid_writes_mamba2_blocks_and_its_scales(tmp_path):
    # A whole number is a number: residual_scale=1 as the command line parses it.
    options = {"ssm_state_size": 8, "ssm_head_count": 4, "ssm_group_count": 2, "residual_scale": 1, "rope": False}
    meta, shape, tensors = write(tmp_path, "granitehybrid", options)
    assert shape.memory == "hybrid" and shape.attention_layers() == (3,)
    assert shape.ssm == SsmShape(conv_kernel=4, inner_size=128, state_size=8, time_step_rank=4, group_count=2)
    assert shape.residual_scale == 1.0 and shape.logit_scale == 0.0 and not shape.rope
    # in_proj: z, x (d_inner each), B, C (groups × state each), dt (one per head).
    assert tensors["blk.0.ssm_in.weight"].ne == (64, 2 * 128 + 2 * 2 * 8 + 4)
    assert tensors["blk.0.ssm_conv1d.weight"].ne == (4, 128 + 2 * 2 * 8)
    assert tensors["blk.0.ssm_norm.weight"].ne == (64, 2)
    assert all(tensors[f"blk.0.{n}"].ggml_type == "F32" for n in ("ssm_a", "ssm_d", "ssm_conv1d.weight"))


def test_pure_recurrent_models_say_zero_heads_and_still_have_a_shape(tmp_path):
    meta, shape, _ = write(tmp_path, "mamba2", {"ssm_state_size": 16})
    assert meta.n_head == 0 and meta.n_ff == 0  # as llama.cpp's converter writes Mamba models
    assert shape.memory == "recurrent" and shape.recurrent_layers == (True,) * 4 and shape.attention_layers() == ()
    assert shape.ssm == SsmShape(conv_kernel=4, inner_size=128, state_size=16, time_step_rank=8, group_count=1)
    _, mamba, tensors = write(tmp_path, "mamba", {"dt_b_c_rms": True, "ssm_dt_rank": 5})
    assert mamba.ssm == SsmShape(conv_kernel=4, inner_size=128, state_size=16, time_step_rank=5, dt_b_c_rms=True)
    assert tensors["blk.0.ssm_x.weight"].ne == (128, 5 + 2 * 16)
    assert tensors["blk.0.ssm_a"].ne == (16, 128)


@pytest.mark.parametrize(
    ("architecture", "options", "message"),
    [
        ("lfm2", {"window": 4}, "takes attention_period, l_cache, sliding_window, tied_output; got window"),
        ("lfm2", {"l_cache": 1}, "l_cache of architecture lfm2 must be at least 2"),
        ("lfm2", {"attention_period": 2.0}, "attention_period of architecture lfm2 must be a whole number"),
        ("granitehybrid", {"ssm_head_count": 3}, "must divide the inner width"),
        ("granitehybrid", {"rope": 1}, "option rope of architecture granitehybrid must be true or false"),
        ("granitehybrid", {"attention_period": 0}, "attention_period of architecture granitehybrid must be at least 2"),
        ("mamba2", {"sliding_window": 8}, "architecture mamba2 takes ssm_conv_kernel"),
        ("mamba", {"ssm_group_count": 1}, "architecture mamba takes dt_b_c_rms"),
    ],
)
def test_unknown_or_invalid_options_are_refused(tmp_path, architecture, options, message):
    with pytest.raises(ValueError, match=message):
        make_test_gguf(tmp_path / "m.gguf", architecture=architecture, n_embd=64, options=options)
    assert not list(tmp_path.iterdir())

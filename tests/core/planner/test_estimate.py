from __future__ import annotations

from typing import Any

import pytest

from qiip_core.planner import (
    MemoryEstimate,
    ModelShape,
    PythonEstimator,
    estimate,
    kv_bytes_per_token,
    layer_split,
    resolves_flash_attn,
)
from qiip_core.planner._types import MIB, FlashAttn

from .conftest import cpu, gpu, shape

# The test models the integration tests generate, by name: (blocks, width, heads, K/V heads, FFN, vocabulary).
SHAPES = {
    "gqa2": (4, 256, 4, 2, 1024, 2000),
    "tiny": (2, 64, 4, 4, 256, 512),
    "wide": (6, 384, 6, 2, 1536, 8000),
    "mqa": (3, 512, 8, 1, 1408, 32000),
    "deep": (8, 128, 2, 2, 512, 300),
    "head128": (2, 256, 2, 1, 640, 50000),
}

# What llama-server (llama.cpp 0.5.0-dev, CPU build) logged: `sched_reserve: CPU compute buffer size` and
# `llama_kv_cache: size`, in MiB to two decimals, for --ctx-size, --parallel, --flash-attn and the cache type.
LOGGED = [
    ("gqa2", 256, 1, "on", "f16", 4.13, 0.50),
    ("gqa2", 256, 1, "off", "f16", 4.25, 0.50),
    ("gqa2", 1024, 3, "on", "q8_0", 8.56, 1.06),
    ("gqa2", 4096, 1, "off", "f16", 43.01, 8.00),
    ("gqa2", 8192, 5, "off", "f16", 83.49, 16.00),
    ("gqa2", 16384, 100, "on", "f16", 28.14, 32.00),
    ("gqa2", 16384, 100, "off", "f16", 191.03, 32.00),
    ("gqa2", 2048, 256, "on", "q8_0", 9.54, 2.12),
    ("tiny", 1024, 3, "off", "f16", 10.90, 0.50),
    ("tiny", 8192, 5, "on", "f16", 10.07, 4.00),
    ("tiny", 2048, 8, "off", "f16", 20.88, 1.00),
    ("wide", 256, 1, "off", "f16", 6.13, 0.75),
    ("wide", 8192, 5, "on", "q8_0", 19.41, 12.75),
    ("wide", 16384, 100, "off", "f16", 267.49, 48.00),
    ("mqa", 1024, 3, "on", "f16", 13.29, 0.75),
    ("mqa", 8192, 5, "off", "f16", 150.13, 6.00),
    ("mqa", 2048, 256, "on", "f16", 32.75, 1.50),
    ("mqa", 2048, 256, "on", "q8_0", 33.25, 0.80),
    ("deep", 4096, 1, "on", "q8_0", 7.79, 8.50),
    ("deep", 16384, 100, "off", "f16", 114.56, 64.00),
    ("head128", 1024, 3, "on", "f16", 6.78, 1.00),
    ("head128", 8192, 5, "on", "q8_0", 13.42, 4.25),
    ("head128", 2048, 256, "off", "f16", 49.83, 2.00),
]


def named(name: str) -> ModelShape:
    n_layers, n_embd, n_head, n_head_kv, n_ff, n_vocab = SHAPES[name]
    return shape(n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab)


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "cache", "compute_mib", "kv_mib"), LOGGED)
def test_cpu_estimate_reproduces_what_llama_server_logged(name, ctx, slots, fa, cache, compute_mib, kv_mib):
    result = estimate(
        named(name), aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=fa, devices=[cpu(10**6)]
    )
    (device,) = result.devices
    # The log rounds to 0.01 MiB; the replayed allocator is exact.
    assert device.compute_mib == pytest.approx(compute_mib, abs=0.005)
    assert device.context_mib == pytest.approx(kv_mib, abs=0.005)
    assert result.host is None and result.flash_attn == (fa == "on")


def test_kv_bytes_per_token_is_exact_for_f16_and_q8_0():
    s = shape(n_layers=4, n_embd=256, n_head=4, n_head_kv=2)  # 2 K/V heads of 64
    assert kv_bytes_per_token(s, "f16") == 4 * 2 * (128 * 2)
    assert kv_bytes_per_token(s, "q8_0") == 4 * 2 * (128 // 32 * 34)


def test_q8_0_needs_heads_in_whole_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        kv_bytes_per_token(shape(n_embd=64, n_head=4), "q8_0")


def test_compute_grows_with_context_and_without_flash_attention():
    s = named("gqa2")

    def compute(ctx: int, fa: FlashAttn) -> float:
        e = estimate(s, aggregate_context=ctx, slots=1, cache_type="f16", flash_attn=fa, devices=[cpu(10**6)])
        return e.devices[0].compute_mib

    assert compute(4096, "on") < compute(8192, "on") < compute(8192, "off")
    # Without flash attention the scores are n_kv x tokens x heads f32, plus the f32 mask: 5 x 4 bytes per cell.
    assert compute(8192, "off") - compute(4096, "off") == pytest.approx(4096 * 512 * (4 * 4 + 4) / MIB)


def test_slots_that_do_not_divide_the_micro_batch_round_it_up():
    s = named("tiny")
    base = estimate(s, aggregate_context=8192, slots=4, cache_type="f16", flash_attn="on", devices=[cpu(10**6)])
    odd = estimate(s, aggregate_context=8192, slots=5, cache_type="f16", flash_attn="on", devices=[cpu(10**6)])
    # 515 tokens instead of 512: three more mask rows of 8192 f16 cells.
    assert odd.devices[0].compute_mib > base.devices[0].compute_mib + 3 * 8192 * 2 / MIB - 0.01


def test_embeddings_reserve_every_token_as_an_output():
    s = named("mqa")
    kw: dict[str, Any] = {
        "aggregate_context": 4096,
        "slots": 1,
        "cache_type": "f16",
        "flash_attn": "on",
        "devices": [cpu(10**6)],
    }
    plain = estimate(s, **kw)
    pooled = PythonEstimator(embeddings=True).estimate(s, **kw)
    # Logged by llama-server with --embeddings --pooling mean: 67.52 MiB (32000 x 512 f32 logits dominate).
    assert pooled.devices[0].compute_mib == pytest.approx(67.52, abs=0.005)
    assert plain.devices[0].compute_mib == pytest.approx(16.26, abs=0.005)


def test_cpu_mode_puts_everything_on_the_one_device():
    s = shape(weights_bytes=123 * MIB)
    e = estimate(s, aggregate_context=4096, slots=2, cache_type="f16", flash_attn="auto", devices=[cpu(10**6)])
    (device,) = e.devices
    assert device.model_mib == 123
    assert device.context_mib == kv_bytes_per_token(s, "f16") * 4096 / MIB
    assert device.output_mib == 2000 * 2 * 4 / MIB  # one row of logits per slot
    assert device.total_mib == device.model_mib + device.context_mib + device.compute_mib + device.output_mib


def test_gpus_split_weights_and_kv_by_layer_and_keep_the_embedding_on_the_host():
    s = ModelShape(
        architecture="llama",
        n_layers=6,
        n_embd=384,
        n_head=6,
        n_head_kv=2,
        head_dim_k=64,
        head_dim_v=64,
        n_ff=1536,
        n_ctx_train=16384,
        n_vocab=8000,
        weights_bytes=6 * 100 + 50 + 20,
        block_bytes=(100,) * 6,
        token_embd_bytes=50,
    )
    devices = [gpu(0, 20000), gpu(1, 10000)]
    e = estimate(s, aggregate_context=8192, slots=4, cache_type="f16", flash_attn="auto", devices=devices)
    assert layer_split([20000, 10000], 7) == (0, 0, 0, 0, 0, 1, 1)
    first, second = e.devices
    assert (first.index, second.index) == (0, 1)
    assert first.model_mib * MIB == pytest.approx(500)  # blocks 0-4
    assert second.model_mib * MIB == pytest.approx(100 + 20)  # block 5 and the output layer
    per_layer = kv_bytes_per_token(s, "f16") // 6 * 8192 / MIB
    assert first.context_mib == pytest.approx(5 * per_layer) and second.context_mib == pytest.approx(per_layer)
    assert e.host is not None and e.host.model_mib * MIB == pytest.approx(50)
    # Inputs (the mask among them) live in host memory; each GPU copies what its layers read.
    assert e.host.compute_mib > 8192 * 512 * 2 / MIB
    assert first.compute_mib > 8192 * 512 * 2 / MIB and second.compute_mib > 8192 * 512 * 2 / MIB


def test_a_tied_output_is_copied_to_the_output_device():
    common: dict[str, Any] = {
        "architecture": "llama",
        "n_layers": 2,
        "n_embd": 64,
        "n_head": 4,
        "n_head_kv": 4,
        "head_dim_k": 16,
        "head_dim_v": 16,
        "n_ff": 256,
        "n_ctx_train": 2048,
        "n_vocab": 512,
        "block_bytes": (10, 10),
        "token_embd_bytes": 64,
    }
    tied = ModelShape(**common, weights_bytes=20 + 64 + 1, tied_output=True)
    untied = ModelShape(**common, weights_bytes=20 + 64 + 64 + 1)
    assert tied.output_bytes() == 64 + 1 == untied.output_bytes()


def test_one_gpu_holds_every_block_and_the_output():
    s = shape(weights_bytes=100 * MIB)
    e = estimate(s, aggregate_context=4096, slots=1, cache_type="q8_0", flash_attn="on", devices=[gpu(0, 1000)])
    assert e.devices[0].context_mib == kv_bytes_per_token(s, "q8_0") * 4096 / MIB
    assert e.host is not None and e.devices[0].output_mib == 0


@pytest.mark.parametrize(
    ("free", "layers", "expected"),
    [
        ([100], 5, (0, 0, 0, 0, 0)),
        ([1, 1], 4, (0, 0, 1, 1)),
        ([1, 1], 33, (0,) * 17 + (1,) * 16),
        ([3, 1], 8, (0,) * 6 + (1,) * 2),
        ([1, 1, 1], 6, (0, 0, 1, 1, 2, 2)),
        ([0, 0], 4, (0, 0, 1, 1)),
        ([1, 0, 1], 4, (0, 0, 2, 2)),
    ],
)
def test_layer_split_follows_free_memory(free, layers, expected):
    assert layer_split(free, layers) == expected


def test_flash_attention_auto_resolution():
    s = shape()
    assert resolves_flash_attn(s, "auto", cpu=True)
    assert resolves_flash_attn(s, "auto", cpu=False)  # head 64: CUDA has the kernel
    assert not resolves_flash_attn(shape(n_embd=64, n_head=4), "auto", cpu=False)  # head 16: it does not
    assert resolves_flash_attn(s, "on", cpu=False) and not resolves_flash_attn(s, "off", cpu=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": []}, "at least one device"),
        ({"devices": [cpu(100), cpu(100)]}, "exactly one CPU device"),
        ({"devices": [gpu(0, 100), cpu(100)]}, "never mixed"),
        ({"aggregate_context": 1000}, "multiple of 256"),
        ({"aggregate_context": 256, "slots": 300}, "at least slots"),
        ({"cache_type": "q8_0", "flash_attn": "off"}, "needs flash attention"),
    ],
)
def test_estimate_rejects_what_llama_cpp_cannot_run(kwargs, message):
    args = {
        "aggregate_context": 4096,
        "slots": 1,
        "cache_type": "f16",
        "flash_attn": "auto",
        "devices": [cpu(1000)],
    } | kwargs
    with pytest.raises(ValueError, match=message):
        estimate(shape(), **args)


def test_python_estimator_is_an_estimator():
    est = PythonEstimator()
    result = est.estimate(
        shape(), aggregate_context=4096, slots=1, cache_type="f16", flash_attn="auto", devices=[cpu(1000)]
    )
    assert isinstance(result, MemoryEstimate) and result.source == est.name == "python"
    assert result.devices[0].record()["compute_mib"] == round(result.devices[0].compute_mib, 2)

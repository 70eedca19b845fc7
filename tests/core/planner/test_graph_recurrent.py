"""The recurrent and hybrid graphs and caches, against what llama-server logged for the same models."""

from __future__ import annotations

import pytest

from qiip_core.planner import ModelShape, estimate
from qiip_core.planner._compute import build_graph, is_modelled
from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import GraphParams, reserve_batch
from qiip_core.planner._memory import memory_layout, recurrent_state_widths
from qiip_core.planner._shape import SsmShape
from qiip_core.planner._types import MIB

from .conftest import cpu


def recurrent_model(
    architecture: str,
    *,
    n_layers: int,
    n_embd: int,
    n_vocab: int,
    attention: tuple[int, ...] = (),
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 768,
    **fields: object,
) -> ModelShape:
    """A shape as `ModelShape.from_metadata` reads the test models; `attention` lists the attending blocks."""
    attends = tuple(il in attention for il in range(n_layers))
    pure = not attention
    memory = "recurrent" if pure else "hybrid"
    if fields.get("swa_window"):
        memory = "hybrid_iswa"
        fields["swa_layers"] = attends
    return ModelShape(
        architecture=architecture,
        n_layers=n_layers,
        n_embd=n_embd,
        n_head=1 if pure else n_head,
        n_head_kv=1 if pure else n_head_kv,
        head_dim_k=1 if pure else n_embd // n_head,
        head_dim_v=1 if pure else n_embd // n_head,
        n_ff=1 if pure else n_ff,
        n_ctx_train=8192,
        n_vocab=n_vocab,
        weights_bytes=10 << 20,
        memory=memory,  # type: ignore[arg-type]
        kv_heads=() if pure else tuple(n_head_kv if a else 0 for a in attends),
        recurrent_layers=tuple(not a for a in attends),
        **fields,  # type: ignore[arg-type]
    )


# The integration tests' models (tests/core/planner/test_family_recurrent.py), by name.
MODELS = {
    "lfm2": recurrent_model("lfm2", n_layers=6, n_embd=256, n_vocab=2000, attention=(2, 5), shortconv_cache=3),
    "lfm2-swa": recurrent_model(
        "lfm2", n_layers=6, n_embd=256, n_vocab=2000, attention=(2, 5), shortconv_cache=3, swa_window=512
    ),
    "lfm2-tied": recurrent_model(
        "lfm2", n_layers=6, n_embd=256, n_vocab=2000, attention=(1, 3, 5), shortconv_cache=4, tied_output=True
    ),
    "granite": recurrent_model(
        "granitehybrid",
        n_layers=6,
        n_embd=256,
        n_vocab=2000,
        attention=(2, 5),
        ssm=SsmShape(conv_kernel=4, inner_size=512, state_size=16, time_step_rank=32, group_count=1),
        residual_scale=0.22,
        logit_scale=8.0,
    ),
    "granite-nope": recurrent_model(
        "granitehybrid",
        n_layers=5,
        n_embd=384,
        n_head=6,
        n_ff=1024,
        n_vocab=3000,
        attention=(4,),
        ssm=SsmShape(conv_kernel=4, inner_size=768, state_size=64, time_step_rank=12, group_count=2),
        rope=False,
    ),
    "mamba2": recurrent_model(
        "mamba2",
        n_layers=4,
        n_embd=256,
        n_vocab=2000,
        ssm=SsmShape(conv_kernel=4, inner_size=512, state_size=32, time_step_rank=8, group_count=1),
    ),
    "mamba": recurrent_model(
        "mamba",
        n_layers=4,
        n_embd=256,
        n_vocab=2000,
        ssm=SsmShape(conv_kernel=4, inner_size=512, state_size=16, time_step_rank=16),
    ),
    "falcon-mamba": recurrent_model(
        "mamba",
        n_layers=3,
        n_embd=192,
        n_vocab=1000,
        ssm=SsmShape(conv_kernel=4, inner_size=384, state_size=8, time_step_rank=12, dt_b_c_rms=True),
    ),
}

# What llama-server (CPU build) logged: `sched_reserve: CPU compute buffer size`, every cache's `size` in log
# order (MiB, two decimals), and `sched_reserve: graph: nodes`.
LOGGED = [
    ("lfm2", 4096, 1, "auto", "f16", 10.01, (4.0, 0.01), 210),
    ("lfm2", 4096, 1, "off", "f16", 43.01, (4.0, 0.01), 220),
    ("lfm2", 512, 8, "off", "f16", 8.01, (0.5, 0.06), 220),
    ("lfm2", 2048, 3, "on", "f16", 8.03, (2.0, 0.02), 210),
    ("lfm2", 8192, 8, "auto", "f16", 14.03, (8.0, 0.06), 210),
    ("lfm2", 16384, 3, "off", "f16", 163.33, (16.0, 0.02), 220),
    ("lfm2", 16384, 8, "on", "q8_0", 22.06, (8.5, 0.06), 234),
    ("lfm2", 4096, 3, "on", "q8_0", 10.07, (2.12, 0.02), 234),
    ("lfm2-swa", 8192, 3, "auto", "f16", 8.03, (0.0, 2.0, 0.02), 210),
    ("lfm2-swa", 4096, 1, "off", "f16", 13.01, (0.0, 1.0, 0.01), 220),
    ("lfm2-swa", 16384, 8, "on", "q8_0", 10.53, (0.0, 2.39, 0.06), 210),
    ("lfm2-tied", 4096, 1, "off", "f16", 43.01, (6.0, 0.01), 227),
    ("lfm2-tied", 16384, 3, "on", "q8_0", 22.09, (12.75, 0.03), 248),
    ("granite", 4096, 1, "auto", "f16", 11.81, (4.0, 0.15), 311),
    ("granite", 4096, 1, "off", "f16", 43.01, (4.0, 0.15), 321),
    ("granite", 512, 3, "off", "f16", 8.73, (0.5, 0.45), 321),
    ("granite", 2048, 3, "on", "f16", 9.05, (2.0, 0.45), 311),
    ("granite", 8192, 8, "auto", "f16", 15.11, (8.0, 1.2), 311),
    ("granite", 16384, 3, "off", "f16", 163.83, (16.0, 0.45), 321),
    ("granite", 16384, 8, "on", "q8_0", 23.14, (8.5, 1.2), 335),
    ("granite-nope", 4096, 3, "auto", "f16", 15.95, (2.0, 2.39), 265),
    ("granite-nope", 1024, 1, "off", "f16", 17.51, (0.5, 0.8), 270),
    ("granite-nope", 512, 8, "off", "f16", 14.47, (0.25, 6.38), 270),
    ("granite-nope", 16384, 8, "on", "q8_0", 29.0, (4.25, 6.38), 277),
    ("mamba2", 4096, 1, "auto", "f16", 6.91, (0.28,), 208),
    ("mamba2", 512, 8, "off", "f16", 7.62, (2.21,), 208),
    ("mamba2", 16384, 3, "on", "f16", 7.26, (0.83,), 208),
    ("mamba2", 2048, 8, "on", "q8_0", 7.62, (2.21,), 208),
    ("mamba", 4096, 1, "auto", "f16", 6.54, (0.15,), 204),
    ("mamba", 512, 8, "off", "f16", 6.85, (1.19,), 204),
    ("mamba", 16384, 3, "on", "q8_0", 6.64, (0.45,), 204),
    ("falcon-mamba", 4096, 1, "auto", "f16", 4.9, (0.05,), 161),
    ("falcon-mamba", 16384, 3, "on", "f16", 4.95, (0.15,), 161),
    ("falcon-mamba", 512, 8, "off", "f16", 5.04, (0.39,), 161),
]


@pytest.mark.parametrize(("name", "ctx", "slots", "fa", "cache", "compute_mib", "caches_mib", "nodes"), LOGGED)
def test_estimates_reproduce_what_llama_server_logged(name, ctx, slots, fa, cache, compute_mib, caches_mib, nodes):
    shape = MODELS[name]
    assert is_modelled(shape)
    result = estimate(shape, aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=fa, devices=[cpu(10**6)])
    (device,) = result.devices
    # The log rounds to 0.01 MiB; the replayed allocator and the cache arithmetic are exact.
    assert device.compute_mib == pytest.approx(compute_mib, abs=0.005)
    assert [c.mib for c in result.caches] == pytest.approx(caches_mib, abs=0.005)
    swa_cells = next((c.cells for c in result.caches if c.kind == "kv_swa"), 0)
    params = GraphParams(
        aggregate_context=ctx, slots=slots, cache_type=cache, flash_attn=result.flash_attn, swa_cells=swa_cells
    )
    assert len(build_graph(shape, params).nodes) == nodes


def test_recurrent_state_widths_are_llama_cpps_n_embd_r_and_n_embd_s():
    # LFM2: (l_cache - 1) × n_embd of convolution state, no scan state.
    assert recurrent_state_widths(MODELS["lfm2"]) == (2 * 256, 0)
    # Mamba-2: (d_conv - 1) × (d_inner + 2 × n_group × d_state), and d_state × d_inner.
    assert recurrent_state_widths(MODELS["granite-nope"]) == (3 * (768 + 2 * 2 * 64), 64 * 768)
    # Mamba: no groups, so the convolution state is (d_conv - 1) × d_inner.
    assert recurrent_state_widths(MODELS["mamba"]) == (3 * 512, 16 * 512)


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_a_hybrid_has_a_kv_cache_of_its_attention_blocks_and_one_state_cell_per_slot(slots):
    shape = MODELS["granite"]
    kv, recurrent = memory_layout(shape, aggregate_context=4096, slots=slots, cache_type="f16")
    assert (kv.kind, kv.cells, kv.layers) == ("kv", 4096, (2, 5))
    assert kv.bytes == 2 * 4096 * 2 * (2 * 64) * 2
    assert (recurrent.kind, recurrent.cells, recurrent.layers) == ("recurrent", slots, (0, 1, 3, 4))
    assert (recurrent.type_k, recurrent.type_v) == ("f32", "f32")
    assert recurrent.k_bytes == 4 * slots * 3 * (512 + 2 * 16) * 4
    assert recurrent.v_bytes == 4 * slots * 16 * 512 * 4
    assert recurrent.layer_bytes(2) == 0 and recurrent.layer_bytes(0) == recurrent.bytes // 4


def test_lfm2_with_a_window_slides_in_every_attention_block_and_keeps_an_empty_full_cache():
    full, sliding, recurrent = memory_layout(MODELS["lfm2-swa"], aggregate_context=8192, slots=3, cache_type="f16")
    assert (full.kind, full.cells, full.layers, full.bytes) == ("kv", 8192, (), 0)
    # pad256(min(ctx, window × slots + ubatch)) cells.
    assert (sliding.kind, sliding.cells, sliding.layers) == ("kv_swa", 2048, (2, 5))
    assert recurrent.cells == 3


def test_a_pure_recurrent_model_has_no_kv_cache():
    (recurrent,) = memory_layout(MODELS["mamba2"], aggregate_context=4096, slots=8, cache_type="f16")
    assert (recurrent.kind, recurrent.cells, recurrent.layers) == ("recurrent", 8, (0, 1, 2, 3))
    assert recurrent.mib == pytest.approx(2.21, abs=0.005)


def params(ctx: int = 4096, slots: int = 1) -> GraphParams:
    return GraphParams(aggregate_context=ctx, slots=slots, cache_type="f16", flash_attn=True)


def test_a_short_convolution_reads_its_state_before_its_input_and_writes_it_back_into_the_cache():
    g = build_graph(MODELS["lfm2"], params())
    ops = [t.op for t in g.nodes]
    # Embedding, then block 0's state read (build_rs) before its own input projection is even in the graph.
    assert ops[:14] == [
        "GET_ROWS",  # token embedding
        "RESHAPE",  # the R cache as [n_embd_r, cells]
        "VIEW",  # the cleared cell ...
        "SCALE",  # ... zeroed in place
        "VIEW",  # s_copy_main
        "GET_ROWS",  # the sequences' states
        "VIEW",  # s_copy_extra
        "GET_ROWS",  # the other cells' states (none in the reserved graph)
        "VIEW",
        "CPY",  # ... copied back
        "RESHAPE",  # the state as [d_conv, n_embd, seqs]
        "RMS_NORM",
        "MUL",
        "RESHAPE",
    ]
    # in_proj, b·x transposed, concatenated after the state; its last columns (a view) copied into a view of R.
    assert ops[14:23] == ["MUL_MAT", "VIEW", "VIEW", "MUL", "TRANSPOSE", "CONCAT", "VIEW", "VIEW", "CPY"]
    # Block 0's convolution enters the graph only when block 1 needs it: after block 1's own state read.
    assert ops[23:30] == ["RESHAPE", "VIEW", "SCALE", "GET_ROWS", "GET_ROWS", "VIEW", "CPY"]
    assert ops.index("SSM_CONV") > 30
    # Every write of state goes into the external cache, never into the compute buffer.
    writes = [t for t in g.nodes if t.op in ("CPY", "SCALE")]
    assert writes and all(t.view_src is not None and t.view_src.external for t in writes)


def test_the_mamba2_scan_returns_its_output_and_the_new_states_in_one_tensor():
    shape = MODELS["mamba2"]
    g = build_graph(shape, params(slots=8))
    (scan, *_) = [t for t in g.nodes if t.op == "SSM_SCAN"]
    n_tok = reserve_batch(params(slots=8))[0]
    assert scan.ne[0] == 512 * n_tok + 32 * 512 * 8  # y for every token, then d_state × d_inner per sequence
    assert [src.op for src in scan.src] == ["RESHAPE", "VIEW", "ADD", "NONE", "VIEW", "VIEW", "VIEW"]
    # The reserved micro-batch: 8 sequences of 64 tokens each.
    (conv, *_) = [t for t in g.nodes if t.op == "SSM_CONV"]
    assert conv.ne[:3] == (512 + 2 * 32, 64, 8)


def test_granite_scales_and_its_rope_switch_change_the_graph_not_the_memory_it_needs():
    base = MODELS["granite"]
    plain = ModelShape(**{**base.__dict__, "residual_scale": 0.0, "logit_scale": 0.0, "rope": False})
    g_base, g_plain = build_graph(base, params()), build_graph(plain, params())
    # Two residual scales per block, the logit scale, and two ropes per attention block.
    assert len(g_base.nodes) - len(g_plain.nodes) == 2 * 6 + 1 + 2 * 2
    assert sum(t.op == "ROPE" for t in g_plain.nodes) == 0
    # Scales run in place and the positions are tiny: within the inputs' 2 KiB.
    base_bytes = compute_buffer_bytes(g_base)[0]
    assert 0 <= base_bytes - compute_buffer_bytes(g_plain)[0] <= 2048
    assert base_bytes / MIB == pytest.approx(11.81, abs=0.005)

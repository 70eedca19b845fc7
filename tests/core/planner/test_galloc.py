"""The allocator replay on small hand-built graphs, where the right answer can be worked out by hand."""

from __future__ import annotations

from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import Graph, GraphParams, Tensor, reserve_batch
from qiip_core.planner._graph_llama import build_llama_graph

from .conftest import shape


def t(
    name: str,
    op: str,
    n: int,
    *src: Tensor,
    device: int = 0,
    external: bool = False,
    is_input: bool = False,
    is_output: bool = False,
) -> Tensor:
    """A 1-d f32 tensor of `n` elements."""
    nb = (4, 4 * n, 4 * n, 4 * n)
    return Tensor(
        name, op, "f32", (n, 1, 1, 1), nb, src, device=device, external=external, is_input=is_input, is_output=is_output
    )


def weight(n: int, device: int = 0) -> Tensor:
    return t("w", "NONE", n, device=device, external=True)


def graph(*outputs: Tensor) -> Graph:
    g = Graph()
    for out in outputs:
        g.expand(out)
    return g


def test_an_in_place_op_takes_over_its_only_parents_memory():
    x = t("x", "NONE", 256, is_input=True)
    norm = t("norm", "RMS_NORM", 256, x)
    scaled = t("scaled", "MUL", 256, norm, weight(256))
    out = t("out", "MUL_MAT", 64, weight(256), scaled, is_output=True)
    # x, norm and scaled share 1 KiB; the output needs its own 256 bytes.
    assert compute_buffer_bytes(graph(out)) == {0: 1024 + 256}


def test_a_parent_with_another_user_is_not_taken_over():
    x = t("x", "NONE", 256, is_input=True)
    a = t("a", "RMS_NORM", 256, x)
    b = t("b", "ADD", 256, a, x)  # x still has a user when a runs: a gets its own memory
    assert compute_buffer_bytes(graph(b)) == {0: 2 * 1024}


def test_outputs_are_never_taken_over():
    def build(output: bool) -> Graph:
        x = t("x", "NONE", 256, is_input=True)
        a = t("a", "MUL_MAT", 256, weight(256), x, is_output=output)
        b = t("b", "RMS_NORM", 256, a)
        return graph(t("c", "GET_ROWS", 256, b, x))  # x lives until the end

    assert compute_buffer_bytes(build(output=False)) == {0: 3 * 1024}  # b runs in a's memory
    assert compute_buffer_bytes(build(output=True)) == {0: 4 * 1024}


def test_freed_memory_is_reused_best_fit():
    x = t("x", "NONE", 8, is_input=True)  # 32 bytes at 0
    big = t("big", "MUL_MAT", 1024, weight(8), x)  # 4096 at 32
    kept = t("kept", "MUL_MAT", 256, weight(8), x)  # 1024 at 4128, used at the end
    small = t("small", "MUL_MAT", 512, weight(8), x)  # 2048 at 5152
    end = t("end", "MUL_MAT", 8, weight(8), x)  # 32 at 7200; then x is freed
    d = t("d", "GET_ROWS", 8, big, small)  # 32 in x's hole; then big and small are freed
    e = t("e", "MUL_MAT", 400, weight(8), d)  # 1600: best fit is small's 2048 hole, not big's 4096
    f = t("f", "GET_ROWS", 1000, e, kept)  # 4000: fits in big's hole (merged with x's)
    g = t("g", "GET_ROWS", 8, f, end, is_output=True)
    # First fit would have put e in big's hole, and f would have grown the buffer.
    assert compute_buffer_bytes(graph(big, kept, small, end, d, e, f, g)) == {0: 32 + 4096 + 1024 + 2048 + 32}


def test_views_keep_their_memory_alive_until_their_last_user():
    x = t("x", "NONE", 256, is_input=True)
    a = t("a", "MUL_MAT", 256, weight(256), x)
    view = Tensor("v", "RESHAPE", "f32", (16, 16, 1, 1), (4, 64, 1024, 1024), src=(a,), view_src=a)
    b = t("b", "MUL_MAT", 256, weight(256), x)  # runs after the view: a is still viewed, b cannot take its place
    c = t("c", "GET_ROWS", 256, view, b)  # x is freed by now: c goes where x was
    assert compute_buffer_bytes(graph(c)) == {0: 3 * 1024}  # were a freed early, b would reuse it: 2 KiB


def test_sizes_are_aligned_per_device():
    x = t("x", "NONE", 1, is_input=True)  # 4 bytes
    y = t("y", "MUL_MAT", 1, weight(1), x, is_output=True)
    assert compute_buffer_bytes(graph(y)) == {0: 64}
    assert compute_buffer_bytes(graph(y), alignment=128) == {0: 256}


def test_tensors_from_another_device_are_copied_at_the_start_of_the_split():
    x = t("x", "NONE", 256, device=9, is_input=True)  # host input
    a = t("a", "MUL_MAT", 256, weight(256, 0), x, device=0)
    b = t("b", "MUL_MAT", 256, weight(256, 1), a, device=1, is_output=True)
    sizes = compute_buffer_bytes(graph(b))
    assert sizes == {9: 1024, 0: 2048, 1: 2048}  # copy of x + a on 0; copy of a + b on 1
    kept = compute_buffer_bytes(graph(b), keep_copies=True)
    assert kept == sizes


def test_reserved_micro_batch():
    assert reserve_batch(GraphParams(aggregate_context=8192, slots=4, cache_type="f16", flash_attn=True)) == (512, 4)
    assert reserve_batch(GraphParams(aggregate_context=8192, slots=3, cache_type="f16", flash_attn=True)) == (513, 3)
    assert reserve_batch(GraphParams(aggregate_context=256, slots=1, cache_type="f16", flash_attn=True)) == (256, 1)
    embed = GraphParams(aggregate_context=8192, slots=2, cache_type="f16", flash_attn=True, embeddings=True)
    assert reserve_batch(embed) == (512, 512)


def test_the_llama_graph_has_llamas_node_order():
    g = build_llama_graph(
        shape(n_layers=2), GraphParams(aggregate_context=1024, slots=1, cache_type="f16", flash_attn=True)
    )
    ops = [n.op for n in g.nodes if not n.is_view]
    # The K/V writes (SET_ROWS) are views of the cache.
    block = ["RMS_NORM", "MUL", "MUL_MAT", "ROPE", "MUL_MAT", "MUL_MAT", "ROPE", "FLASH_ATTN_EXT", "MUL_MAT"]
    ffn = ["ADD", "RMS_NORM", "MUL", "MUL_MAT", "MUL_MAT", "GLU", "MUL_MAT", "ADD"]
    # As GGML_SCHED_DEBUG prints it: Q, V then K; gate before up; the last block keeps only the output rows.
    assert ops == ["GET_ROWS", *block, *ffn, *block, "GET_ROWS", "GET_ROWS", *ffn, "RMS_NORM", "MUL", "MUL_MAT"]
    assert [n.name for n in g.nodes if n.op == "MUL_MAT"][:4] == ["Qcur-0", "Vcur-0", "Kcur-0", "attn_out-0"]
    inputs = [leaf.name for leaf in g.leafs if leaf.is_input]
    assert inputs == [
        "inp_tokens",
        "inp_embd",
        "inp_pos",
        "attn_inp_k_idxs",
        "attn_inp_v_idxs",
        "attn_inp_kq_mask",
        "out_ids",
    ]


def test_quantised_caches_add_the_hadamard_rotations():
    params = GraphParams(aggregate_context=1024, slots=1, cache_type="q8_0", flash_attn=True)
    g = build_llama_graph(shape(n_layers=1), params)
    names = [n.name for n in g.nodes if n.op == "MUL_MAT"]
    assert names.count("hadamard") == 4  # Q, K, V and the attention output
    assert {leaf.name for leaf in g.leafs if leaf.is_input} >= {"attn_inp_k_rot", "attn_inp_v_rot"}

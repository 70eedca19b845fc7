"""Rebuild the graph llama.cpp reserves its compute buffer for, tensor by tensor: the primitives and the blocks
every architecture shares.

llama-server sizes its compute buffer once, at start-up (`llama_context::sched_reserve`): it builds the
worst-case prompt-processing graph for one micro-batch and lets ggml's graph allocator (`ggml-alloc.c`) plan
every intermediate tensor into one buffer, reusing memory as tensors die. The buffer is the allocator's
high-water mark. To predict it we build the same graph here, in the same order, with the same shapes, types,
views and flags, and run the same allocator over it (`_galloc.py`).

This module holds what every architecture's graph is made of:

- `Tensor` and `Graph`: enough of `struct ggml_tensor` and `ggml_cgraph` for the allocator;
- `Builder`: the ggml calls (`ggml_mul_mat`, `ggml_view_*`, `ggml_set_rows`, …) reduced to shapes and strides;
- `GraphParams` and `reserve_batch`: the micro-batch `sched_reserve` plans for;
- the shared blocks of `llm_graph_context` (`src/llama-graph.cpp`): the input embedding (`build_inp_embd`), one
  K/V cache's inputs (`kv_inputs`: indices, mask, Hadamard rotations), the cache writes and multi-head attention
  (`attention`: `build_attn` and `build_attn_mha`), and the output layer.

The graphs themselves are per architecture: `_graph_llama.py` (llama and llama-style decoders),
`_graph_gemma.py` (Gemma 2 and 3, sliding-window attention), and `_compute.py` picks one for a model.

The micro-batch is what `sched_reserve` asks for: `min(n_ctx, n_ubatch)` tokens rounded up to a multiple of
the slot count (`graph_reserve`), all K/V cells visible (`init_full`), and as many outputs as llama-server
allows per batch: one per slot for generation (`server_output_limits`), every token with `--embeddings`.
Quantised K/V caches with 64-multiple heads add llama.cpp's Hadamard rotations (`attn_rot_k/v`).

Each tensor carries the device it runs on, so several GPUs can be planned: blocks on the device their layer is
assigned to, the input layer on the host, the output layer on the output device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from qiip_core.planner._arch import Pooling
from qiip_core.planner._shape import ModelShape, row_bytes
from qiip_core.planner._types import CacheType

__all__ = [
    "Builder",
    "Graph",
    "GraphParams",
    "KvInputs",
    "Tensor",
    "attention",
    "embed_tokens",
    "kv_inputs",
    "layer_devices",
    "ne4",
    "output_layer",
    "pooling_stage",
    "reserve_batch",
]

N_OUTPUTS_EMBEDDINGS = 2048
"""Outputs per batch with `--embeddings`: llama.cpp's default `n_batch`, capped by the tokens. llama-server
lowers its batch to the micro-batch with embeddings, so every token of the micro-batch is an output."""

INPLACE_OPS = frozenset(
    {
        "FILL",
        "SCALE",
        "DIAG_MASK_ZERO",
        "DIAG_MASK_INF",
        "ADD",
        "ADD_ID",
        "ADD1",
        "SUB",
        "MUL",
        "DIV",
        "SQR",
        "SQRT",
        "LOG",
        "UNARY",
        "ROPE",
        "RMS_NORM",
        "CLAMP",
        "SOFT_MAX",
    }
)
"""Ops whose result may take over a dying parent's memory (`ggml_op_can_inplace` in `ggml-alloc.c`, forward ops)."""


@dataclass(eq=False, slots=True)
class Tensor:
    """One ggml tensor of the graph: enough of `struct ggml_tensor` for the allocator to plan it."""

    name: str
    op: str
    """The ggml op (`MUL_MAT`, `VIEW`, …); `NONE` for leafs (weights, caches, inputs)."""
    dtype: str
    ne: tuple[int, int, int, int]
    """Elements per dimension."""
    nb: tuple[int, int, int, int]
    """Bytes per step in each dimension (strides)."""
    src: tuple[Tensor, ...] = ()
    view_src: Tensor | None = None
    """The tensor whose memory a view shares (always the root, never another view)."""
    device: int = 0
    external: bool = False
    """Its memory is not the compute buffer's: weights and the K/V cache."""
    is_input: bool = False
    """`ggml_set_input`: allocated before any node, so nothing overwrites it."""
    is_output: bool = False
    """`ggml_set_output`: never freed and never taken over in place."""
    _nbytes: int = field(default=-1, init=False, repr=False)
    """`nbytes()` once computed (-1 before): the allocator asks for it at every step, and shape and strides
    never change once a tensor is made."""
    alloc_children: int = field(default=0, init=False, repr=False)
    """The allocator's count of this tensor's users still to run (`hash_node.n_children`), during a replay."""
    alloc_views: int = field(default=0, init=False, repr=False)
    """The allocator's count of views of it still in use (`hash_node.n_views`), during a replay."""
    alloc_live: bool = field(default=False, init=False, repr=False)
    """Whether the allocator holds memory for it (`hash_node.allocated`), during a replay."""
    alloc_offset: int = field(default=0, init=False, repr=False)
    """Its offset in the device's buffer in bytes (`hash_node.offset`), during a replay."""

    @property
    def is_view(self) -> bool:
        """Whether it only shares another tensor's memory."""
        return self.view_src is not None

    def nbytes(self) -> int:
        """Its size in bytes, as `ggml_nbytes` computes it from shape and strides."""
        if self._nbytes < 0:
            self._nbytes = _size(self.dtype, self.ne, self.nb)
        return self._nbytes

    def same_layout(self, other: Tensor) -> bool:
        """`ggml_are_same_layout`: same type, shape and strides."""
        return self.dtype == other.dtype and self.ne == other.ne and self.nb == other.nb


@functools.cache
def _blocks(dtype: str) -> tuple[int, int]:
    """(bytes per block, elements per block) of a ggml type."""
    return (34, 32) if dtype == "q8_0" else (row_bytes(dtype, 1), 1)


# A graph makes hundreds of thousands of tensors from a few dozen distinct (type, shape) pairs, so their strides
# and sizes are computed once per pair. Both are pure functions of their arguments; a row `row_bytes` refuses
# raises on every call (a cache keeps no exception).
@functools.lru_cache(maxsize=4096)
def _contiguous(dtype: str, ne: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    nb0 = _blocks(dtype)[0]
    nb1 = row_bytes(dtype, ne[0])
    return (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


@functools.lru_cache(maxsize=4096)
def _size(dtype: str, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int]) -> int:
    """`ggml_nbytes`: bytes spanned by a tensor of type `dtype`, shape `ne` and strides `nb` (bytes)."""
    if any(n <= 0 for n in ne):
        return 0
    type_bytes, block = _blocks(dtype)
    if block > 1:
        return ne[0] * nb[0] // block + sum((ne[i] - 1) * nb[i] for i in range(1, 4))
    return type_bytes + sum((ne[i] - 1) * nb[i] for i in range(4))


def ne4(*dims: int) -> tuple[int, int, int, int]:
    """A ggml shape from up to four dimensions, innermost first; missing ones are 1."""
    padded = (*dims, 1, 1, 1, 1)[:4]
    return (padded[0], padded[1], padded[2], padded[3])


_ne = ne4


@dataclass(slots=True)
class Graph:
    """Nodes and leafs in the order `ggml_build_forward_expand` records them (depth first, sources in order)."""

    nodes: list[Tensor] = field(default_factory=list)
    leafs: list[Tensor] = field(default_factory=list)
    _seen: set[Tensor] = field(default_factory=set)

    def expand(self, tensor: Tensor) -> None:
        """Add `tensor` and every source not yet in the graph (`ggml_visit_parents_graph`)."""
        seen, leafs, nodes = self._seen, self.leafs, self.nodes
        if tensor in seen:
            return
        seen.add(tensor)
        # (tensor, index of its next source to visit); a source already seen is skipped before it is pushed.
        stack: list[tuple[Tensor, int]] = [(tensor, 0)]
        push, pop = stack.append, stack.pop
        while stack:
            t, i = pop()
            src = t.src
            while i < len(src) and src[i] in seen:
                i += 1
            if i < len(src):
                child = src[i]
                seen.add(child)
                push((t, i + 1))
                push((child, 0))
            elif t.op == "NONE":
                leafs.append(t)
            else:
                nodes.append(t)


@dataclass(frozen=True, kw_only=True)
class GraphParams:
    """The server settings the reserved graph depends on."""

    aggregate_context: int
    """K/V cells (`--ctx-size`, a multiple of 256): every cell is visible in the reserved graph."""
    slots: int
    """Parallel sequences (`--parallel`)."""
    cache_type: CacheType
    """K and V cache type (`--cache-type-k/-v`)."""
    flash_attn: bool
    """Whether flash attention runs (`--flash-attn on`, or `auto` resolved to enabled)."""
    n_ubatch: int = 512
    """Micro-batch size in tokens (`--ubatch-size`, llama-server's default 512)."""
    embeddings: bool = False
    """`--embeddings`: every token is an output and the pooling stage follows (`ModelShape.embeddings_pooling`)."""
    layer_devices: tuple[int, ...] = ()
    """Device of each block and, last, of the output layer; empty means all on the host."""
    host: int = 0
    """Device of the input layer and the graph inputs (the host CPU)."""
    swa_cells: int = 0
    """Cells of the sliding-window K/V cache (`_memory.swa_cells`); 0 without one."""


def reserve_batch(params: GraphParams) -> tuple[int, int]:
    """Tokens and outputs of the micro-batch `sched_reserve` plans for.

    Args:
        params: the server settings.

    Returns:
        `(tokens, outputs)`: `min(n_ctx, n_ubatch)` rounded up to a multiple of the slots (`graph_reserve`),
        and one output per slot (or every token with embeddings), never more than the tokens.
    """
    tokens = min(params.aggregate_context, params.n_ubatch)
    outputs = min(tokens, N_OUTPUTS_EMBEDDINGS if params.embeddings else params.slots)
    return -(-tokens // params.slots) * params.slots, outputs


class Builder:
    """The ggml calls llama.cpp's graphs use, reduced to what memory depends on.

    Every tensor it makes is placed on `device`, which a graph changes as it walks the layers.
    """

    def __init__(self, device: int) -> None:
        self.device = device

    def new(self, name: str, op: str, dtype: str, ne: tuple[int, int, int, int], *src: Tensor) -> Tensor:
        return Tensor(name, op, dtype, ne, _contiguous(dtype, ne), src=src, device=self.device)

    def leaf(self, name: str, dtype: str, ne: tuple[int, int, int, int], *, external: bool = False) -> Tensor:
        nb = _contiguous(dtype, ne)
        return Tensor(name, "NONE", dtype, ne, nb, device=self.device, external=external, is_input=not external)

    def view(self, a: Tensor, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int], op: str = "VIEW") -> Tensor:
        root = a.view_src if a.view_src is not None else a
        device = root.device
        return Tensor(a.name, op, a.dtype, ne, nb, src=(a,), view_src=root, device=device)

    def reshape(self, a: Tensor, ne: tuple[int, int, int, int]) -> Tensor:
        return self.view(a, ne, _contiguous(a.dtype, ne), "RESHAPE")

    def permute(self, a: Tensor, axes: tuple[int, int, int, int]) -> Tensor:
        ne, nb = [0] * 4, [0] * 4
        for i, axis in enumerate(axes):
            ne[axis], nb[axis] = a.ne[i], a.nb[i]
        return self.view(a, _ne(*ne), (nb[0], nb[1], nb[2], nb[3]), "PERMUTE")

    def mul_mat(self, name: str, a: Tensor, b: Tensor) -> Tensor:
        return self.new(name, "MUL_MAT", "f32", _ne(a.ne[1], b.ne[1], b.ne[2], b.ne[3]), a, b)

    def same(self, name: str, op: str, a: Tensor, *src: Tensor) -> Tensor:
        return self.new(name, op, a.dtype, a.ne, a, *src)

    def set_rows(self, cache: Tensor, rows: Tensor, idxs: Tensor) -> Tensor:
        # The result is a view of the cache: it writes into the K/V buffer, never into the compute buffer.
        root = cache.view_src if cache.view_src is not None else cache
        return Tensor(cache.name, "SET_ROWS", cache.dtype, cache.ne, cache.nb, (cache, rows, idxs), root, root.device)

    def weight(self, name: str, *ne: int) -> Tensor:
        return self.leaf(name, "f16", _ne(*ne), external=True)

    def hadamard(self, cur: Tensor, rot: Tensor) -> Tensor:
        # llama_mul_mat_hadamard: reshape to rows of the rotation's width, multiply, reshape back.
        n = rot.ne[0]
        flat = self.reshape(cur, _ne(n, math.prod(cur.ne) // n))
        return self.reshape(self.mul_mat("hadamard", rot, flat), cur.ne)

    def get_rows(self, name: str, a: Tensor, rows: Tensor) -> Tensor:
        """`ggml_get_rows`: the rows of `a` that `rows` (a 1-D index) names, as F32."""
        return self.new(name, "GET_ROWS", "f32", _ne(a.ne[0], rows.ne[0], a.ne[2]), a, rows)

    def norm(self, name: str, x: Tensor, weight: str, *, op: str = "RMS_NORM", bias: bool = False) -> Tensor:
        """`build_norm`: normalise `x` (RMS or layer norm), then multiply by the weight and add the bias."""
        cur = self.same(f"norm-{name}", op, x)
        cur = self.same(name, "MUL", cur, self.weight(f"{weight}.weight", x.ne[0]))
        if bias:
            cur = self.same(name, "ADD", cur, self.weight(f"{weight}.bias", x.ne[0]))
        return cur


def _strides_2d(t: Tensor) -> tuple[int, int, int, int]:
    # ggml_view_2d(t, ne0 * ne1, ne2, nb[2], 0): merge the first two dimensions.
    return (t.nb[0], t.nb[2], t.nb[2] * t.ne[2], t.nb[2] * t.ne[2])


def layer_devices(shape: ModelShape, params: GraphParams) -> tuple[int, ...]:
    """The device of each block and, last, of the output layer: `params.layer_devices`, or all on the host.

    Raises:
        ValueError: `layer_devices` does not have one entry per block and one for the output.
    """
    devices = params.layer_devices or (params.host,) * shape.total_layers
    if len(devices) != shape.total_layers:
        raise ValueError(f"layer_devices needs {shape.total_layers} entries (blocks and output).")
    return devices


def project_qkv(
    b: Builder,
    shape: ModelShape,
    il: int,
    cur: Tensor,
    *,
    n_tok: int,
    inp_pos: Tensor | None,
    biases: bool = False,
    qk_norm: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """`build_qkv` with separate projections, then the per-head Q/K norms and the rotary embedding.

    Args:
        b: the builder, on the layer's device.
        shape: the model.
        il: the block.
        cur: the normalised input, `[n_embd, n_tok]`.
        n_tok: tokens of the micro-batch.
        inp_pos: the positions input; None for a block without rotary embedding.
        biases: the projections add biases (Qwen 2).
        qk_norm: Q and K get an RMS norm per head before the rotation (Qwen 3, Gemma 3, LFM2).

    Returns:
        Q `[head_dim_k, n_head, n_tok]`, K `[head_dim_k, n_head_kv, n_tok]` and V `[head_dim_v, n_head_kv, n_tok]`.
    """
    e, blk = shape.n_embd, f"blk.{il}"
    n_head, n_kv_head = shape.n_head, shape.layer_kv_heads(il)
    dk, dv = shape.layer_head_dims(il)
    widths = {"q": n_head * dk, "k": n_kv_head * dk, "v": n_kv_head * dv}
    projected = {}
    for part, width in widths.items():
        t = b.mul_mat(f"{part.upper()}cur-{il}", b.weight(f"{blk}.attn_{part}", e, width), cur)
        if biases:
            t = b.same(f"{part.upper()}cur-{il}", "ADD", t, b.weight(f"{blk}.attn_{part}.bias", width))
        projected[part] = t
    q = b.reshape(projected["q"], ne4(dk, n_head, n_tok))
    k = b.reshape(projected["k"], ne4(dk, n_kv_head, n_tok))
    v = b.reshape(projected["v"], ne4(dv, n_kv_head, n_tok))
    if qk_norm:
        q = b.norm(f"Qcur_normed-{il}", q, f"{blk}.attn_q_norm")
        k = b.norm(f"Kcur_normed-{il}", k, f"{blk}.attn_k_norm")
    if inp_pos is not None:
        q = b.same(f"Qcur-{il}", "ROPE", q, inp_pos)
        k = b.same(f"Kcur-{il}", "ROPE", k, inp_pos)
    return q, k, v


def embed_tokens(b: Builder, g: Graph, shape: ModelShape, n_tok: int) -> Tensor:
    """`build_inp_embd`: look the tokens up in the embedding; the embedding-vector input is still allocated.

    Returns:
        The `[n_embd, n_tok]` embeddings, on the builder's device (the host).
    """
    e = shape.n_embd
    tok_embd = b.leaf("token_embd.weight", "f16", _ne(e, shape.n_vocab), external=True)
    tokens = b.leaf("inp_tokens", "i32", _ne(n_tok))
    inp_embd = b.leaf("inp_embd", "f32", _ne(e, n_tok))
    embd = b.get_rows("embd", tok_embd, tokens)
    # ggml_build_forward_select keeps both paths in the graph; the token path is expanded first.
    g.expand(embd)
    g.expand(inp_embd)
    return embd


@dataclass(frozen=True, slots=True)
class KvInputs:
    """One K/V cache's graph inputs (`llm_graph_input_attn_kv`), and what its views need."""

    cells: int
    """Cells of the cache; in the reserved graph every one is visible (`n_kv`)."""
    k_idxs: Tensor
    """`attn_inp_k_idxs`: where each token's K row goes."""
    v_idxs: Tensor
    """`attn_inp_v_idxs`: where each V row (or, transposed, each V element) goes."""
    kq_mask: Tensor
    """`attn_inp_kq_mask`: `[n_kv, n_tokens]`, F16 with flash attention and F32 without."""
    k_rot: Tensor | None
    """`attn_inp_k_rot`: the K Hadamard rotation of a quantised cache, or None."""
    v_rot: Tensor | None
    """`attn_inp_v_rot`: the V Hadamard rotation, or None."""
    v_width: int
    """Elements of one cell's V row in the cache (`n_embd_v_gqa_max` when transposed)."""


def kv_inputs(
    b: Builder,
    shape: ModelShape,
    *,
    layers: tuple[int, ...],
    cells: int,
    n_tok: int,
    flash_attn: bool,
    cache_type: CacheType,
) -> KvInputs:
    """The inputs of one K/V cache holding `layers` (`build_attn_inp_kv_impl`, `build_input_k/v_idxs/rot`).

    Args:
        b: the builder, on the host device.
        shape: the model.
        layers: the blocks the cache holds (its head widths decide the Hadamard rotations).
        cells: the cache's size in cells.
        n_tok: tokens of the micro-batch.
        flash_attn: flash attention runs (V is stored untransposed, the mask is F16).
        cache_type: the cache's element type.
    """
    v_max = max((shape.layer_kv_heads(il) * shape.layer_head_dims(il)[1] for il in range(shape.n_layers)), default=0)
    k_idxs = b.leaf("attn_inp_k_idxs", "i64", _ne(n_tok))
    # Without flash attention the V cache is transposed and written element by element.
    v_idxs = b.leaf("attn_inp_v_idxs", "i64", _ne(n_tok if flash_attn else n_tok * v_max))
    kq_mask = b.leaf("attn_inp_kq_mask", "f16" if flash_attn else "f32", _ne(cells, n_tok))
    # attn_rot_k/v: a quantised cache whose layers share one head width, a multiple of 64.
    widths_k = {shape.layer_head_dims(il)[0] for il in layers}
    widths_v = {shape.layer_head_dims(il)[1] for il in layers}
    quantised = cache_type != "f16"
    k_rot = v_rot = None
    if quantised and len(widths_k) == 1 and shape.head_dim_k % 64 == 0:
        (dk,) = widths_k
        n = 64
        while dk % (n * 2) == 0:
            n *= 2
        k_rot = b.leaf("attn_inp_k_rot", "f32", _ne(n, n))
    if quantised and len(widths_v) == 1 and shape.head_dim_v % 64 == 0:
        v_rot = b.leaf("attn_inp_v_rot", "f32", _ne(64, 64))
    return KvInputs(cells, k_idxs, v_idxs, kq_mask, k_rot, v_rot, v_max)


def attention(
    b: Builder,
    g: Graph,
    *,
    il: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    inp: KvInputs,
    cache_type: CacheType,
    flash_attn: bool,
    iswa: bool = False,
    softcap: bool = False,
) -> Tensor:
    """Write K and V into the cache and attend over every cell (`build_attn` with `build_attn_mha`).

    Args:
        b: the builder, on the layer's device.
        g: the graph.
        il: the block.
        q: `[head_dim_k, n_head, n_tok]` queries, roped.
        k: `[head_dim_k, n_head_kv, n_tok]` keys, roped.
        v: `[head_dim_v, n_head_kv, n_tok]` values.
        inp: the inputs of the cache this block's K/V live in.
        cache_type: the cache's element type.
        flash_attn: flash attention runs.
        iswa: the model has a sliding-window cache; llama.cpp then expands Q, K, V in that order (Q, V, K
            otherwise).
        softcap: attention logits are squashed before the softmax (`attn_soft_cap`: scale, tanh, scale, in
            place; flash attention does it inside its kernel).

    Returns:
        `[head_dim_v * n_head, n_tok]`: the attention output before the output projection.
    """
    dk, n_kv_head, n_tok = k.ne[0], k.ne[1], k.ne[2]
    dv = v.ne[0]
    n_kv, ct, fa = inp.cells, cache_type, flash_attn
    if inp.k_rot is not None:
        q, k = b.hadamard(q, inp.k_rot), b.hadamard(k, inp.k_rot)
    if inp.v_rot is not None:
        v = b.hadamard(v, inp.v_rot)
    # Q, V, K (or Q, K, V with a sliding-window cache) are expanded together, then the cache writes.
    for t in (q, k, v) if iswa else (q, v, k):
        g.expand(t)
    v_width = n_kv_head * dv if fa else inp.v_width
    cache_k = b.leaf(f"cache_k_l{il}", ct, _ne(n_kv_head * dk, n_kv), external=True)
    cache_v = b.leaf(f"cache_v_l{il}", ct, _ne(v_width, n_kv), external=True)
    g.expand(b.set_rows(cache_k, b.view(k, _ne(n_kv_head * dk, n_tok), _strides_2d(k)), inp.k_idxs))
    if fa:
        g.expand(b.set_rows(cache_v, b.view(v, _ne(n_kv_head * dv, n_tok), _strides_2d(v)), inp.v_idxs))
    else:
        flat_v = b.reshape(b.reshape(v, _ne(n_kv_head * dv, n_tok)), _ne(1, n_kv_head * dv * n_tok))
        g.expand(b.set_rows(b.reshape(cache_v, _ne(1, v_width * n_kv)), flat_v, inp.v_idxs))
    kh, kr = row_bytes(ct, dk), row_bytes(ct, n_kv_head * dk)
    k_all = b.view(cache_k, _ne(dk, n_kv_head, n_kv), (cache_k.nb[0], kh, kr, kr * n_kv))
    if fa:
        vh, vr = row_bytes(ct, dv), row_bytes(ct, v_width)
        v_all = b.view(cache_v, _ne(dv, n_kv_head, n_kv), (cache_v.nb[0], vh, vr, vr * n_kv))
    else:
        vc = row_bytes(ct, n_kv)
        v_all = b.view(cache_v, _ne(n_kv, n_kv_head, dv), (cache_v.nb[0], vc * dv, vc, vc * v_width))
    q4 = b.permute(b.view(q, q.ne, (q.nb[0], q.nb[1], q.nb[2], q.nb[2] * q.ne[2])), (0, 2, 1, 3))
    k4, v4 = b.permute(k_all, (0, 2, 1, 3)), b.permute(v_all, (0, 2, 1, 3))
    if fa:
        att = b.new(f"fattn-{il}", "FLASH_ATTN_EXT", "f32", _ne(v4.ne[0], q4.ne[2], q4.ne[1]), q4, k4, v4, inp.kq_mask)
        g.expand(att)
        cur = b.reshape(att, _ne(att.ne[0] * att.ne[1], att.ne[2]))
    else:
        kq = b.mul_mat(f"kq-{il}", k4, q4)
        if softcap:
            kq = b.same(f"kq_scaled_2-{il}", "SCALE", b.same(f"kq_tanh-{il}", "UNARY", b.same(f"kq-{il}", "SCALE", kq)))
        kq = b.same(f"kq_soft_max-{il}", "SOFT_MAX", kq, inp.kq_mask)
        kqv = b.permute(b.mul_mat(f"kqv-{il}", v4, kq), (0, 2, 1, 3))
        cur = b.new(f"kqv_out-{il}", "CONT", "f32", _ne(kqv.ne[0] * kqv.ne[1], kqv.ne[2]), kqv)
        g.expand(cur)
    if inp.v_rot is not None:
        cur = b.hadamard(cur, inp.v_rot)
    return cur


def output_layer(
    b: Builder,
    g: Graph,
    shape: ModelShape,
    params: GraphParams,
    inp: Tensor,
    *,
    device: int,
    softcap: bool = False,
) -> None:
    """The output norm and the logits, and the pooling stage with `--embeddings` (`pooling_stage`).

    Args:
        b: the builder.
        g: the graph.
        shape: the model.
        params: the server settings.
        inp: the last block's output, `[n_embd, n_outputs]`.
        device: the output layer's device.
        softcap: the logits are squashed (`final_logit_softcapping`: scale, tanh, scale; all in place).
    """
    b.device = device
    result_norm = b.norm("result_norm", inp, "output_norm")
    result_norm.is_output = True
    logits = b.mul_mat("result_output", b.weight("output.weight", shape.n_embd, shape.n_vocab), result_norm)
    if softcap:
        logits = b.same("result_output", "UNARY", b.same("result_output", "SCALE", logits))
        logits = b.same("result_output", "SCALE", logits)
    logits.is_output = True
    g.expand(logits)
    if params.embeddings:
        pooling_stage(b, g, params, result_norm, pooling=shape.embeddings_pooling, device=device)


def pooling_stage(b: Builder, g: Graph, params: GraphParams, embd: Tensor, *, pooling: Pooling, device: int) -> None:
    """`build_pooling` with `--embeddings`: one vector per sequence (one per slot when reserving).

    Args:
        b: the builder.
        g: the graph.
        params: the server settings.
        embd: the rows pooled (`t_embd`: the output norm's result, or an encoder's last block), `[n_embd, tokens]`.
        pooling: `ModelShape.embeddings_pooling`. `mean` multiplies the transposed rows by `inp_mean`
            `[tokens, slots]`; `cls`, `last` and `rank` pick a row per sequence (`inp_cls`; rank's classifier
            head, a few rows, is not modelled); `none` keeps the rows.
        device: the output layer's device.
    """
    if pooling == "none":
        return
    n_tok = reserve_batch(params)[0]
    b.device = params.host
    if pooling == "mean":
        inp_mean = b.leaf("inp_mean", "f32", _ne(n_tok, params.slots))
        b.device = device
        # mul_mat(cont(transpose(embd)), inp_mean): the transposed rows are copied out whole.
        transposed = b.permute(embd, (1, 0, 2, 3))
        cont = b.new("cont", "CONT", "f32", _ne(transposed.ne[0], transposed.ne[1]), transposed)
        pooled = b.mul_mat("result_embd_pooled", cont, inp_mean)
    else:
        inp_cls = b.leaf("inp_cls", "i32", _ne(params.slots))
        b.device = device
        pooled = b.get_rows("result_embd_pooled", embd, inp_cls)
    pooled.is_output = True
    g.expand(pooled)

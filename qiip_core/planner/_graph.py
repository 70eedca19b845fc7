"""Rebuild the graph llama.cpp reserves its compute buffer for, tensor by tensor.

llama-server sizes its compute buffer once, at start-up (`llama_context::sched_reserve`): it builds the
worst-case prompt-processing graph for one micro-batch and lets ggml's graph allocator (`ggml-alloc.c`) plan
every intermediate tensor into one buffer, reusing memory as tensors die. The buffer is the allocator's
high-water mark. To predict it we build the same graph here, in the same order, with the same shapes, types,
views and flags, and run the same allocator over it (`_galloc.py`).

The graph is llama's (`src/models/llama.cpp`, `llm_graph_context::build_*` in `src/llama-graph.cpp`):

```
inp_tokens ─ get_rows(token_embd) ─┐                                          (input layer, on the host)
for each block:                    ▼
  rms_norm · attn_norm ─ Q, K, V = mul_mat ─ rope(Q), rope(K) ─ set_rows into the K/V cache
  flash attention:  flash_attn_ext(Q, K cache, V cache, kq_mask)             [head_v, n_head, tokens]
  otherwise:        kq = mul_mat(K cache, Q) [n_kv, tokens, n_head] ─ soft_max(kq, kq_mask) ─ mul_mat(V, kq) ─ cont
  mul_mat(wo) + residual ─ rms_norm · ffn_norm ─ gate, up = mul_mat ─ swiglu ─ mul_mat(down) + residual
rms_norm · output_norm ─ mul_mat(output) = logits [n_vocab, outputs]        (output layer)
```

The micro-batch is what `sched_reserve` asks for: `min(n_ctx, n_ubatch)` tokens rounded up to a multiple of
the slot count (`graph_reserve`), all K/V cells visible (`init_full`), and as many outputs as llama-server
allows per batch: one per slot for generation (`server_output_limits`), every token with `--embeddings`.
Quantised K/V caches with 64-multiple heads add llama.cpp's Hadamard rotations (`attn_rot_k/v`).

Each tensor carries the device it runs on, so several GPUs can be planned: blocks on the device their layer is
assigned to, the input layer on the host, the output layer on the output device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from qiip_core.planner._shape import ModelShape, row_bytes
from qiip_core.planner._types import CacheType

__all__ = ["Graph", "GraphParams", "Tensor", "build_llama_graph", "reserve_batch"]

N_OUTPUTS_EMBEDDINGS = 2048
"""Outputs per batch with `--embeddings`: llama-server's `n_batch` (default 2048), capped by the tokens."""

INPLACE_OPS = frozenset({"ADD", "MUL", "RMS_NORM", "ROPE", "SOFT_MAX", "SCALE", "UNARY"})
"""Ops whose result may take over a dying parent's memory (`ggml_op_can_inplace`, the ones llama uses)."""


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

    @property
    def is_view(self) -> bool:
        """Whether it only shares another tensor's memory."""
        return self.view_src is not None

    def nbytes(self) -> int:
        """Its size in bytes, as `ggml_nbytes` computes it from shape and strides."""
        if any(n <= 0 for n in self.ne):
            return 0
        type_bytes, block = _blocks(self.dtype)
        if block > 1:
            return self.ne[0] * self.nb[0] // block + sum((self.ne[i] - 1) * self.nb[i] for i in range(1, 4))
        return type_bytes + sum((self.ne[i] - 1) * self.nb[i] for i in range(4))

    def same_layout(self, other: Tensor) -> bool:
        """`ggml_are_same_layout`: same type, shape and strides."""
        return self.dtype == other.dtype and self.ne == other.ne and self.nb == other.nb


def _blocks(dtype: str) -> tuple[int, int]:
    """(bytes per block, elements per block) of a ggml type."""
    return (34, 32) if dtype == "q8_0" else (row_bytes(dtype, 1), 1)


def _contiguous(dtype: str, ne: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    nb0 = _blocks(dtype)[0]
    nb1 = row_bytes(dtype, ne[0])
    return (nb0, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])


def _ne(*dims: int) -> tuple[int, int, int, int]:
    padded = (*dims, 1, 1, 1, 1)[:4]
    return (padded[0], padded[1], padded[2], padded[3])


@dataclass(slots=True)
class Graph:
    """Nodes and leafs in the order `ggml_build_forward_expand` records them (depth first, sources in order)."""

    nodes: list[Tensor] = field(default_factory=list)
    leafs: list[Tensor] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)

    def expand(self, tensor: Tensor) -> None:
        """Add `tensor` and every source not yet in the graph (`ggml_visit_parents_graph`)."""
        stack: list[tuple[Tensor, int]] = [(tensor, 0)]
        while stack:
            t, i = stack.pop()
            if i == 0:
                if id(t) in self._seen:
                    continue
                self._seen.add(id(t))
            if i < len(t.src):
                stack.append((t, i + 1))
                stack.append((t.src[i], 0))
            elif t.op == "NONE":
                self.leafs.append(t)
            else:
                self.nodes.append(t)


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
    """`--embeddings --pooling mean`: every token is an output and a mean-pooling stage follows."""
    layer_devices: tuple[int, ...] = ()
    """Device of each block and, last, of the output layer; empty means all on the host."""
    host: int = 0
    """Device of the input layer and the graph inputs (the host CPU)."""


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


class _Builder:
    """The ggml calls llama's graph uses, reduced to what memory depends on."""

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


def build_llama_graph(shape: ModelShape, params: GraphParams) -> Graph:
    """Build the worst-case prompt-processing graph llama-server reserves its compute buffer for.

    Args:
        shape: the model.
        params: the server settings.

    Returns:
        The graph, nodes and leafs in llama.cpp's order, each tensor tagged with its device.
    """
    layer_devices = params.layer_devices or (params.host,) * shape.total_layers
    if len(layer_devices) != shape.total_layers:
        raise ValueError(f"layer_devices needs {shape.total_layers} entries (blocks and output).")
    n_tok, n_out = reserve_batch(params)
    n_kv = params.aggregate_context
    e, n_head, n_kv_head, dk, dv = shape.n_embd, shape.n_head, shape.n_head_kv, shape.head_dim_k, shape.head_dim_v
    fa, ct = params.flash_attn, params.cache_type
    quantised = ct != "f16"
    g = Graph()
    b = _Builder(params.host)

    # Input layer (build_inp_embd): the token path runs, the embedding-vector input is still allocated.
    tok_embd = b.leaf("token_embd.weight", "f16", _ne(e, shape.n_vocab), external=True)
    tokens = b.leaf("inp_tokens", "i32", _ne(n_tok))
    inp_embd = b.leaf("inp_embd", "f32", _ne(e, n_tok))
    embd = b.new("embd", "GET_ROWS", "f32", _ne(e, n_tok), tok_embd, tokens)
    g.expand(embd)
    g.expand(inp_embd)
    inp_pos = b.leaf("inp_pos", "i32", _ne(n_tok))
    k_idxs = b.leaf("attn_inp_k_idxs", "i64", _ne(n_tok))
    # Without flash attention the V cache is transposed and written element by element.
    v_idxs = b.leaf("attn_inp_v_idxs", "i64", _ne(n_tok if fa else n_tok * n_kv_head * dv))
    kq_mask = b.leaf("attn_inp_kq_mask", "f16" if fa else "f32", _ne(n_kv, n_tok))
    k_rot_n = 64
    while dk % (k_rot_n * 2) == 0:
        k_rot_n *= 2
    k_rot = b.leaf("attn_inp_k_rot", "f32", _ne(k_rot_n, k_rot_n)) if quantised and dk % 64 == 0 else None
    v_rot = b.leaf("attn_inp_v_rot", "f32", _ne(64, 64)) if quantised and dv % 64 == 0 else None
    out_ids = b.leaf("out_ids", "i32", _ne(n_out))

    inp = embd
    for il in range(shape.n_layers):
        b.device = layer_devices[il]

        blk = f"blk.{il}"
        residual = inp
        cur = b.same(f"norm-{il}", "RMS_NORM", inp)
        cur = b.same(f"attn_norm-{il}", "MUL", cur, b.weight(f"{blk}.attn_norm", e))
        q = b.mul_mat(f"Qcur-{il}", b.weight(f"{blk}.attn_q", e, n_head * dk), cur)
        k = b.mul_mat(f"Kcur-{il}", b.weight(f"{blk}.attn_k", e, n_kv_head * dk), cur)
        v = b.mul_mat(f"Vcur-{il}", b.weight(f"{blk}.attn_v", e, n_kv_head * dv), cur)
        q, k = b.reshape(q, _ne(dk, n_head, n_tok)), b.reshape(k, _ne(dk, n_kv_head, n_tok))
        v = b.reshape(v, _ne(dv, n_kv_head, n_tok))
        q = b.same(f"Qcur-{il}", "ROPE", q, inp_pos)
        k = b.same(f"Kcur-{il}", "ROPE", k, inp_pos)
        if k_rot is not None:
            q, k = b.hadamard(q, k_rot), b.hadamard(k, k_rot)
        if v_rot is not None:
            v = b.hadamard(v, v_rot)
        # build_attn: Q, V, K are expanded together, then the cache writes.
        g.expand(q)
        g.expand(v)
        g.expand(k)
        cache_k = b.leaf(f"cache_k_l{il}", ct, _ne(n_kv_head * dk, n_kv), external=True)
        cache_v = b.leaf(f"cache_v_l{il}", ct, _ne(n_kv_head * dv, n_kv), external=True)
        g.expand(b.set_rows(cache_k, b.view(k, _ne(n_kv_head * dk, n_tok), _strides_2d(k)), k_idxs))
        if fa:
            g.expand(b.set_rows(cache_v, b.view(v, _ne(n_kv_head * dv, n_tok), _strides_2d(v)), v_idxs))
        else:
            flat_v = b.reshape(b.reshape(v, _ne(n_kv_head * dv, n_tok)), _ne(1, n_kv_head * dv * n_tok))
            g.expand(b.set_rows(b.reshape(cache_v, _ne(1, n_kv_head * dv * n_kv)), flat_v, v_idxs))
        kh, kr = row_bytes(ct, dk), row_bytes(ct, n_kv_head * dk)
        k_all = b.view(cache_k, _ne(dk, n_kv_head, n_kv), (cache_k.nb[0], kh, kr, kr * n_kv))
        if fa:
            vh, vr = row_bytes(ct, dv), row_bytes(ct, n_kv_head * dv)
            v_all = b.view(cache_v, _ne(dv, n_kv_head, n_kv), (cache_v.nb[0], vh, vr, vr * n_kv))
        else:
            vc = row_bytes(ct, n_kv)
            v_all = b.view(cache_v, _ne(n_kv, n_kv_head, dv), (cache_v.nb[0], vc * dv, vc, vc * dv * n_kv_head))
        q4 = b.permute(b.view(q, q.ne, (q.nb[0], q.nb[1], q.nb[2], q.nb[2] * q.ne[2])), (0, 2, 1, 3))
        k4, v4 = b.permute(k_all, (0, 2, 1, 3)), b.permute(v_all, (0, 2, 1, 3))
        if fa:
            att = b.new(f"fattn-{il}", "FLASH_ATTN_EXT", "f32", _ne(v4.ne[0], q4.ne[2], q4.ne[1]), q4, k4, v4, kq_mask)
            g.expand(att)
            cur = b.reshape(att, _ne(att.ne[0] * att.ne[1], att.ne[2]))
        else:
            kq = b.mul_mat(f"kq-{il}", k4, q4)
            kq = b.same(f"kq_soft_max-{il}", "SOFT_MAX", kq, kq_mask)
            kqv = b.permute(b.mul_mat(f"kqv-{il}", v4, kq), (0, 2, 1, 3))
            cur = b.new(f"kqv_out-{il}", "CONT", "f32", _ne(kqv.ne[0] * kqv.ne[1], kqv.ne[2]), kqv)
            g.expand(cur)
        if v_rot is not None:
            cur = b.hadamard(cur, v_rot)
        cur = b.mul_mat(f"attn_out-{il}", b.weight(f"{blk}.attn_output", n_head * dv, e), cur)
        if il == shape.n_layers - 1:
            # Only the output rows go on from the last block.
            cur = b.new("last_attn", "GET_ROWS", "f32", _ne(e, n_out), cur, out_ids)
            residual = b.new("last_inp", "GET_ROWS", "f32", _ne(e, n_out), residual, out_ids)
        ffn_inp = b.same(f"ffn_inp-{il}", "ADD", cur, residual)
        cur = b.same(f"norm-{il}", "RMS_NORM", ffn_inp)
        cur = b.same(f"ffn_norm-{il}", "MUL", cur, b.weight(f"{blk}.ffn_norm", e))
        up = b.mul_mat(f"ffn_up-{il}", b.weight(f"{blk}.ffn_up", e, shape.n_ff), cur)
        gate = b.mul_mat(f"ffn_gate-{il}", b.weight(f"{blk}.ffn_gate", e, shape.n_ff), cur)
        act = b.same(f"ffn_swiglu-{il}", "GLU", gate, up)
        down = b.mul_mat(f"ffn_out-{il}", b.weight(f"{blk}.ffn_down", shape.n_ff, e), act)
        inp = b.same(f"l_out-{il}", "ADD", down, ffn_inp)

    b.device = layer_devices[-1]
    cur = b.same("norm", "RMS_NORM", inp)
    result_norm = b.same("result_norm", "MUL", cur, b.weight("output_norm.weight", e))
    result_norm.is_output = True
    logits = b.mul_mat("result_output", b.weight("output.weight", e, shape.n_vocab), result_norm)
    logits.is_output = True
    g.expand(logits)
    if params.embeddings:
        # build_pooling, mean: mul_mat(cont(transpose(embd)), inp_mean [tokens, slots]).
        b.device = params.host
        inp_mean = b.leaf("inp_mean", "f32", _ne(n_tok, params.slots))
        b.device = layer_devices[-1]
        transposed = b.permute(result_norm, (1, 0, 2, 3))
        cont = b.new("cont", "CONT", "f32", _ne(transposed.ne[0], transposed.ne[1]), transposed)
        pooled = b.mul_mat("result_embd_pooled", cont, inp_mean)
        pooled.is_output = True
        g.expand(pooled)
    return g


def _strides_2d(t: Tensor) -> tuple[int, int, int, int]:
    # ggml_view_2d(t, ne0 * ne1, ne2, nb[2], 0): merge the first two dimensions.
    return (t.nb[0], t.nb[2], t.nb[2] * t.ne[2], t.nb[2] * t.ne[2])

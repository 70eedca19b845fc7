"""The allocator replay and the graph walk against a plain reference: the straightforward code they were before they
were made fast (one Python call per allocator step, a state dict with `setdefault`, every source pushed and
checked on pop), kept here verbatim in meaning. Every buffer must be the same to the byte, and every graph the same
nodes in the same order, across model shapes, flash attention, cache types, embeddings and layer splits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import pytest

from qiip_core.planner import ModelShape
from qiip_core.planner._compute import build_graph
from qiip_core.planner._estimate import CPU_ALIGNMENT, CUDA_ALIGNMENT, layer_split
from qiip_core.planner._galloc import compute_buffer_bytes
from qiip_core.planner._graph import INPLACE_OPS, Graph, GraphParams, Tensor, _blocks
from qiip_core.planner._types import CacheType
from tests.core.planner.conftest import shape as llama_shape

_UNBOUNDED = 1 << 62


def _reference_nbytes(t: Tensor) -> int:
    if any(n <= 0 for n in t.ne):
        return 0
    type_bytes, block = _blocks(t.dtype)
    if block > 1:
        return t.ne[0] * t.nb[0] // block + sum((t.ne[i] - 1) * t.nb[i] for i in range(1, 4))
    return type_bytes + sum((t.ne[i] - 1) * t.nb[i] for i in range(4))


class _ReferenceDynamic:
    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, _UNBOUNDED]]
        self.max_size = 0

    def aligned(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int:
        size = self.aligned(size)
        best, best_size = -1, _UNBOUNDED + 1
        for i, (_, block_size) in enumerate(self.blocks[:-1]):
            if size <= block_size <= best_size:
                best, best_size = i, block_size
        if best == -1:
            best = len(self.blocks) - 1
        block = self.blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, offset + size)
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self.aligned(size)
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:
                block[1] += size
                if i + 1 < len(blocks) and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        position = next((i for i, block in enumerate(blocks) if block[0] >= offset), len(blocks))
        blocks.insert(position, [offset, size])


@dataclass
class _ReferenceState:
    children: int = 0
    views: int = 0
    allocated: bool = False
    offset: int = 0


class _ReferenceAllocator:
    def __init__(self, alignment: int, sources: Mapping[int, tuple[Tensor, ...]]) -> None:
        self.dyn = _ReferenceDynamic(alignment)
        self.states: dict[int, _ReferenceState] = {}
        self.sources = sources

    def state(self, t: Tensor) -> _ReferenceState:
        return self.states.setdefault(id(t), _ReferenceState())

    def src(self, t: Tensor) -> tuple[Tensor, ...]:
        return self.sources.get(id(t), t.src)

    def allocate(self, t: Tensor) -> None:
        s = self.state(t)
        if t.external or s.allocated or t.view_src is not None:
            return
        s.allocated = True
        if t.op in INPLACE_OPS:
            for parent in self.src(t):
                p = self.state(parent)
                if not p.allocated or parent.is_output or not t.same_layout(parent):
                    continue
                if p.children != 1 or p.views != 0:
                    continue
                s.offset = p.offset
                p.allocated = False
                extra = self.dyn.aligned(_reference_nbytes(parent)) - self.dyn.aligned(_reference_nbytes(t))
                if extra > 0:
                    self.dyn.free(p.offset + self.dyn.aligned(_reference_nbytes(t)), extra)
                return
        s.offset = self.dyn.alloc(_reference_nbytes(t))

    def release(self, t: Tensor) -> None:
        if t.is_output:
            return
        s = self.state(t)
        self.dyn.free(s.offset, _reference_nbytes(t))
        s.allocated = False

    def run(self, leafs: list[Tensor], nodes: list[Tensor]) -> int:
        for leaf in leafs:
            self.allocate(leaf)
        for node in nodes:
            if node.view_src is not None:
                self.state(node.view_src).views += 1
            if node.is_input:
                self.allocate(node)
            for src in self.src(node):
                self.state(src).children += 1
                if src.is_input:
                    self.allocate(src)
        for node in nodes:
            for parent in self.src(node):
                self.allocate(parent)
            self.allocate(node)
            for parent in self.src(node):
                p = self.state(parent)
                p.children -= 1
                if p.children or p.views:
                    continue
                if parent.view_src is not None:
                    root = self.state(parent.view_src)
                    root.views -= 1
                    if root.views == 0 and root.children == 0 and root.allocated:
                        self.release(parent.view_src)
                elif p.allocated:
                    self.release(parent)
        return self.dyn.max_size


def _reference_buffers(graph: Graph, alignment: Mapping[int, int], keep_copies: bool) -> dict[int, int]:
    parts: dict[int, tuple[list[Tensor], list[Tensor], dict[int, tuple[Tensor, ...]]]] = {}
    for leaf in graph.leafs:
        parts.setdefault(leaf.device, ([], [], {}))[0].append(leaf)
    copies: dict[tuple[int, int], Tensor] = {}
    current, split_start = -1, 0
    for node in graph.nodes:
        device = (node.view_src or node).device
        _, nodes, rewired = parts.setdefault(device, ([], [], {}))
        if device != current and not node.is_view:
            current, split_start = device, len(nodes)
        sources = []
        for src in node.src:
            owner = src.view_src or src
            if owner.external or owner.device == device:
                sources.append(src)
                continue
            copy = copies.get((id(src), device))
            if copy is None:
                copy = Tensor(f"{src.name}#copy", "NONE", src.dtype, src.ne, src.nb, device=device)
                copy.is_output = keep_copies
                copies[(id(src), device)] = copy
                nodes.insert(split_start, copy)
            sources.append(copy)
        if sources != list(node.src):
            rewired[id(node)] = tuple(sources)
        nodes.append(node)
    return {
        device: _ReferenceAllocator(alignment.get(device, 32), rewired).run(leafs, nodes)
        for device, (leafs, nodes, rewired) in sorted(parts.items())
    }


def _reference_expand(graph: Graph, tensor: Tensor) -> None:
    stack: list[tuple[Tensor, int]] = [(tensor, 0)]
    while stack:
        t, i = stack.pop()
        if i == 0:
            if t in graph._seen:
                continue
            graph._seen.add(t)
        if i < len(t.src):
            stack.append((t, i + 1))
            stack.append((t.src[i], 0))
        elif t.op == "NONE":
            graph.leafs.append(t)
        else:
            graph.nodes.append(t)


SHAPES = {
    "llama, 6 blocks": llama_shape(n_layers=6),
    "llama, 12 blocks, wide heads": llama_shape(n_layers=12, n_embd=512, n_head=4, n_head_kv=4),
    "qwen3 (Q/K norms), 5 blocks": replace(llama_shape(n_layers=5), architecture="qwen3"),
    "llama, 9 blocks, MQA": llama_shape(n_layers=9, n_embd=384, n_head=6, n_head_kv=1),
}
SPLITS = {
    "CPU": (),
    "one GPU": (20_000,),
    "two GPUs, alike": (40_000, 40_000),
    "three GPUs, uneven": (70_000, 10_000, 30_000),
    "eight GPUs": (81_559,) * 8,
}
SIZINGS: list[tuple[int, int, CacheType, bool, bool]] = [  # context, slots, cache type, flash attention, embeddings
    (4096, 1, "f16", True, False),
    (8192, 4, "f16", False, False),
    (1024, 3, "q8_0", True, False),
    (256, 2, "f16", True, True),
    (768, 1, "f16", False, True),
]


def _graph_and_alignment(
    model: ModelShape, free_mib: tuple[int, ...], sizing: tuple[int, int, CacheType, bool, bool]
) -> tuple[GraphParams, dict[int, int]]:
    ctx, slots, cache_type, fa, embeddings = sizing
    params = GraphParams(
        aggregate_context=ctx, slots=slots, cache_type=cache_type, flash_attn=fa, embeddings=embeddings
    )
    if not free_mib:
        return params, {0: CPU_ALIGNMENT}
    split = layer_split(list(free_mib), model.total_layers)
    params = replace(params, layer_devices=split, host=len(free_mib))
    return params, dict.fromkeys(set(split), CUDA_ALIGNMENT) | {len(free_mib): CPU_ALIGNMENT}


@pytest.mark.parametrize("split", SPLITS.values(), ids=list(SPLITS))
@pytest.mark.parametrize("model", SHAPES.values(), ids=list(SHAPES))
def test_every_buffer_is_the_plain_replays_to_the_byte(model: ModelShape, split: tuple[int, ...]) -> None:
    for sizing in SIZINGS:
        params, alignment = _graph_and_alignment(model, split, sizing)
        keep = len(split) > 1
        fast = compute_buffer_bytes(build_graph(model, params), alignment=alignment, keep_copies=keep)
        plain = _reference_buffers(build_graph(model, params), alignment, keep)
        assert fast == plain, sizing


@pytest.mark.parametrize("split", [(), (70_000, 10_000, 30_000)], ids=["CPU", "three GPUs"])
@pytest.mark.parametrize("model", SHAPES.values(), ids=list(SHAPES))
def test_the_graph_walk_records_the_plain_walks_nodes_in_its_order(
    model: ModelShape, split: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    params, _ = _graph_and_alignment(model, split, SIZINGS[1])
    fast = build_graph(model, params)
    monkeypatch.setattr(Graph, "expand", _reference_expand)
    plain = build_graph(model, params)

    def described(tensors: list[Tensor]) -> list[tuple[str, str, str, tuple[int, ...], tuple[int, ...], int]]:
        return [(t.name, t.op, t.dtype, t.ne, t.nb, t.device) for t in tensors]

    assert described(fast.nodes) == described(plain.nodes)
    assert described(fast.leafs) == described(plain.leafs)
    assert [t.nbytes() for t in fast.nodes] == [_reference_nbytes(t) for t in plain.nodes]

"""ggml's graph allocator, replayed: the compute buffer a graph needs on each device.

This is `ggml_gallocr_alloc_graph_impl` and its dynamic allocator (`ggml_dyn_tallocr`) from `ggml-alloc.c`,
step for step, over the tensors `_graph.py` builds:

1. Leafs that are graph inputs are placed first (nothing may overwrite them), in graph order.
2. Children and views of every tensor are counted.
3. Nodes are placed in execution order. A node whose op may run in place (`ggml_op_can_inplace`) takes over
   the memory of a parent that has no other user, when the layouts match; otherwise the allocator picks the
   smallest free block that fits (best fit, the trailing block last), growing the buffer only when none does.
4. After each node, parents with no remaining users are freed and adjacent free blocks merge.

The buffer is the high-water mark. With several devices the scheduler (`ggml_backend_sched`) splits the graph
where the device changes and copies each tensor a split needs from another device into that device's buffer
at the start of the split; each device has its own allocator. With one device there are no copies and the
result is the buffer `sched_reserve: CPU compute buffer size` logs, to the byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from qiip_core.planner._graph import INPLACE_OPS, Graph, Tensor

__all__ = ["compute_buffer_bytes"]

_UNBOUNDED = 1 << 62
"""Size of the trailing free block of a fresh chunk: ggml caps it at the buffer type's maximum size."""


class _DynamicAllocator:
    """`ggml_dyn_tallocr` with one chunk: free blocks sorted by offset, the last one unbounded."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, _UNBOUNDED]]  # [offset, size]
        self.max_size = 0

    def aligned(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def alloc(self, size: int) -> int:
        alignment = self.alignment
        size = -(-size // alignment) * alignment
        blocks = self.blocks
        best, best_size = -1, _UNBOUNDED + 1
        # Best fit among every block but the last; ties go to the later block (`<=`), as in ggml.
        for i in range(len(blocks) - 1):
            block_size = blocks[i][1]
            if size <= block_size <= best_size:
                best, best_size = i, block_size
        if best == -1:
            best = len(blocks) - 1
        block = blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del blocks[best]
        if offset + size > self.max_size:
            self.max_size = offset + size
        return offset

    def free(self, offset: int, size: int) -> None:
        alignment = self.alignment
        size = -(-size // alignment) * alignment
        blocks = self.blocks
        end = offset + size
        for i, block in enumerate(blocks):
            start = block[0]
            if start + block[1] == offset:
                block[1] += size
                if i + 1 < len(blocks) and start + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if end == start:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == offset:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        position = len(blocks)
        for i, block in enumerate(blocks):
            if block[0] >= offset:
                position = i
                break
        blocks.insert(position, [offset, size])


class _GraphAllocator:
    """`ggml_gallocr` for one device's buffer.

    Its bookkeeping per tensor (`struct hash_node`) lives in the tensor's `alloc_*` slots, which
    `compute_buffer_bytes` clears before a replay: no lookup and no record per tensor, millions of steps per plan.
    Only this device's tensors are counted here, and the external ones (weights, caches) any part may read, which
    are never allocated, so no count of theirs is ever read.
    """

    def __init__(self, alignment: int, sources: Mapping[Tensor, tuple[Tensor, ...]]) -> None:
        self.dyn = _DynamicAllocator(alignment)
        self.sources = sources

    def allocate(self, t: Tensor) -> None:
        if t.external or t.alloc_live or t.view_src is not None:
            return
        t.alloc_live = True
        if t.op in INPLACE_OPS:
            for parent in self.sources.get(t, t.src):
                if self._take_over(t, parent):
                    return
        t.alloc_offset = self.dyn.alloc(t.nbytes())

    def _take_over(self, t: Tensor, parent: Tensor) -> bool:
        # Only memory this allocator owns (never a view, never an external buffer), never an output.
        if not parent.alloc_live or parent.is_output or not t.same_layout(parent):
            return False
        if parent.alloc_children != 1 or parent.alloc_views != 0:
            return False
        t.alloc_offset = parent.alloc_offset
        parent.alloc_live = False
        extra = self.dyn.aligned(parent.nbytes()) - self.dyn.aligned(t.nbytes())
        if extra > 0:
            self.dyn.free(parent.alloc_offset + self.dyn.aligned(t.nbytes()), extra)
        return True

    def release(self, t: Tensor) -> None:
        if t.is_output:
            return
        self.dyn.free(t.alloc_offset, t.nbytes())
        t.alloc_live = False

    def run(self, leafs: list[Tensor], nodes: list[Tensor]) -> int:
        allocate = self.allocate
        get = self.sources.get
        for leaf in leafs:
            allocate(leaf)
        for node in nodes:
            if node.view_src is not None:
                node.view_src.alloc_views += 1
            if node.is_input:
                allocate(node)
            for src in get(node, node.src):
                src.alloc_children += 1
                if src.is_input:
                    allocate(src)
        for node in nodes:
            parents = get(node, node.src)
            for parent in parents:
                # `allocate` returns at once for these; the test here saves a call per parent.
                if not (parent.external or parent.view_src is not None or parent.alloc_live):
                    allocate(parent)
            allocate(node)
            for parent in parents:
                parent.alloc_children -= 1
                if parent.alloc_children or parent.alloc_views:
                    continue
                root = parent.view_src
                if root is not None:
                    root.alloc_views -= 1
                    if root.alloc_views == 0 and root.alloc_children == 0 and root.alloc_live:
                        self.release(root)
                elif parent.alloc_live:
                    self.release(parent)
        return self.dyn.max_size


@dataclass(slots=True)
class _DeviceGraph:
    """One device's share of the graph: its leafs, its nodes and the sources rewired to copies."""

    leafs: list[Tensor]
    nodes: list[Tensor]
    sources: dict[Tensor, tuple[Tensor, ...]]


def _split_by_device(graph: Graph, keep_copies: bool) -> dict[int, _DeviceGraph]:
    """Each device's leafs and nodes, with the scheduler's copies of tensors from other devices."""
    parts: dict[int, _DeviceGraph] = {}

    def part(device: int) -> _DeviceGraph:
        found = parts.get(device)
        if found is None:
            found = parts[device] = _DeviceGraph([], [], {})
        return found

    for leaf in graph.leafs:
        part(leaf.device).leafs.append(leaf)
    copies: dict[tuple[Tensor, int], Tensor] = {}
    current, split_start = -1, 0
    mine, mine_device = None, -1
    for node in graph.nodes:
        device = node.view_src.device if node.view_src is not None else node.device
        if mine is None or device != mine_device:
            mine, mine_device = part(device), device
        if device != current and node.view_src is None:
            current, split_start = device, len(mine.nodes)
        rewired: list[Tensor] | None = None
        for position, src in enumerate(node.src):
            owner = src.view_src if src.view_src is not None else src
            if owner.external or owner.device == device:
                if rewired is not None:
                    rewired.append(src)
                continue
            if rewired is None:
                rewired = list(node.src[:position])
            copy = copies.get((src, device))
            if copy is None:
                # ggml_dup_tensor_layout: same shape and strides, in this device's buffer, at the split's start.
                copy = Tensor(f"{src.name}#copy", "NONE", src.dtype, src.ne, src.nb, device=device)
                copy.is_output = keep_copies
                copies[(src, device)] = copy
                mine.nodes.insert(split_start, copy)
            rewired.append(copy)
        if rewired is not None:
            mine.sources[node] = tuple(rewired)
        mine.nodes.append(node)
    return parts


def compute_buffer_bytes(
    graph: Graph, *, alignment: Mapping[int, int] | int = 32, keep_copies: bool = False
) -> dict[int, int]:
    """The compute buffer each device needs for `graph`, in bytes.

    Args:
        graph: the graph, each tensor tagged with its device.
        alignment: the buffer alignment in bytes, one for all devices or per device: 32 for CPU and pinned
            host buffers (`TENSOR_ALIGNMENT`), 128 for CUDA.
        keep_copies: never free copies between devices, as the scheduler does with pipeline parallelism
            (several GPUs).

    Returns:
        Bytes per device, for every device that has a tensor in the graph.

    The replay keeps its bookkeeping in the graph's tensors (`Tensor.alloc_*`, cleared here first), so a graph
    is replayed by one caller at a time; the estimator builds a graph per replay and shares none.
    """
    for t in graph.leafs:
        t.alloc_children = t.alloc_views = t.alloc_offset = 0
        t.alloc_live = False
    for t in graph.nodes:
        t.alloc_children = t.alloc_views = t.alloc_offset = 0
        t.alloc_live = False
    result = {}
    for device, part in sorted(_split_by_device(graph, keep_copies).items()):
        align = alignment if isinstance(alignment, int) else alignment.get(device, 32)
        result[device] = _GraphAllocator(align, part.sources).run(part.leafs, part.nodes)
    return result

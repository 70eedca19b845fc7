"""The fleet as the console sees it: nodes by id, request rate and time to first token, and the table's columns.

Pure: no Textual and no I/O. The app feeds it a snapshot (`load`), then events (`apply`) and polls
(`update`, `apply_metrics`); each call answers a `FleetDelta` naming the nodes that changed, so the fleet table
touches only those rows instead of rebuilding itself.

```
fleet = Fleet()
delta = fleet.load(await client.nodes())          # every node changed; unknown ones removed
delta = fleet.apply(event)                        # one NodeEvent from client.events()
delta = fleet.apply_metrics(await client.metrics(), at_s=clock())
```
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qiip_core.client import NodeEvent, NodeInfo
from qiip_core.nodes import NodeStatus
from qiip_core.planner import DeviceMemory

__all__ = [
    "FLEET_COLUMNS",
    "STATUS_ORDER",
    "Fleet",
    "FleetColumn",
    "FleetDelta",
    "devices_of",
    "gpu_totals",
    "matches",
    "training_context",
]

STATUS_ORDER: tuple[str, ...] = (
    NodeStatus.HEALTHY,
    NodeStatus.DRAINING,
    NodeStatus.RELAUNCHING,
    NodeStatus.PROVISIONING,
    NodeStatus.UNKNOWN,
    NodeStatus.UNHEALTHY,
    NodeStatus.RELAUNCH_FAILED,
    NodeStatus.FAILED,
)
"""Statuses from serving to broken: the order of the summary line and of sorting by status."""


@dataclass(frozen=True)
class FleetDelta:
    """Which nodes a change touched."""

    changed: frozenset[str] = frozenset()
    """Ids added or updated."""
    removed: frozenset[str] = frozenset()
    """Ids that left the fleet."""

    def __bool__(self) -> bool:
        return bool(self.changed or self.removed)

    def merge(self, other: FleetDelta) -> FleetDelta:
        """Both changes, as if applied one after the other."""
        removed = (self.removed - other.changed) | other.removed
        return FleetDelta((self.changed - other.removed) | other.changed, removed)


class Fleet:
    """Every node the daemon reported, and what the console computed from its metrics."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        """The nodes by id, as last reported."""
        self.ttft_p50_s: dict[str, float] = {}
        """Median time to first token by node, in seconds, when the daemon's metrics carry it."""
        self.requests_per_s: float | None = None
        """Requests per second between the last two metrics polls; None until two polls were seen."""
        self._last_total: tuple[float, float] | None = None

    def load(self, nodes: Iterable[NodeInfo]) -> FleetDelta:
        """Replace the fleet with a snapshot (`client.nodes()`).

        Returns:
            Every node of the snapshot as changed, and the nodes it no longer has as removed.
        """
        fresh = {node.id: node for node in nodes}
        removed = frozenset(self.nodes) - frozenset(fresh)
        changed = frozenset(i for i, node in fresh.items() if self.nodes.get(i) != node)
        self.nodes = fresh
        for node_id in removed:
            self.ttft_p50_s.pop(node_id, None)
        return FleetDelta(changed, removed)

    def apply(self, event: NodeEvent) -> FleetDelta:
        """Apply one change from the daemon's event stream.

        Returns:
            The node as changed or removed; empty when the event repeats what is known.
        """
        node = event.node
        if event.change == "removed":
            if self.nodes.pop(node.id, None) is None:
                return FleetDelta()
            self.ttft_p50_s.pop(node.id, None)
            return FleetDelta(removed=frozenset({node.id}))
        return self.update(node)

    def update(self, node: NodeInfo) -> FleetDelta:
        """Record a node read by a poll (`client.node(id)`) or an event.

        Returns:
            The node as changed, or nothing when it is unchanged.
        """
        if self.nodes.get(node.id) == node:
            return FleetDelta()
        self.nodes[node.id] = node
        return FleetDelta(changed=frozenset({node.id}))

    def apply_metrics(self, payload: Mapping[str, Any], *, at_s: float) -> FleetDelta:
        """Take a `client.metrics()` answer: the request rate, and the TTFT median of each node when present.

        The rate is the growth of the request counters since the previous call; a counter that went down (the
        daemon restarted) starts the measurement again.

        Args:
            payload: `{"by_model": {...}, "by_node": {node: {"requests", ..., "ttft_p50_s"?}}}`.
            at_s: when it was read, on the console's clock, in seconds.

        Returns:
            The nodes whose TTFT changed.
        """
        by_node = payload.get("by_node") or {}
        by_model = payload.get("by_model") or {}
        counts = by_model or by_node
        total = float(sum(float(c.get("requests", 0)) for c in counts.values()))
        previous, self._last_total = self._last_total, (at_s, total)
        if previous is not None and at_s > previous[0] and total >= previous[1]:
            self.requests_per_s = (total - previous[1]) / (at_s - previous[0])
        elif previous is not None:
            self.requests_per_s = None
        changed = set()
        for node_id in self.nodes:
            value = (by_node.get(node_id) or {}).get("ttft_p50_s")
            ttft = float(value) if isinstance(value, int | float) and math.isfinite(value) else None
            if ttft != self.ttft_p50_s.get(node_id):
                changed.add(node_id)
                if ttft is None:
                    del self.ttft_p50_s[node_id]
                else:
                    self.ttft_p50_s[node_id] = ttft
        return FleetDelta(changed=frozenset(changed))

    def status_counts(self) -> list[tuple[str, int]]:
        """Nodes by status, in `STATUS_ORDER` (statuses no node has are left out, unknown names last)."""
        counts = Counter(node.status for node in self.nodes.values())
        ordered = [(s, counts.pop(s)) for s in STATUS_ORDER if s in counts]
        return ordered + sorted(counts.items())


def matches(node: NodeInfo, query: str) -> bool:
    """Whether the filter `query` (a case-insensitive substring) finds the node's id, model, status or engine."""
    if not query:
        return True
    needle = query.casefold()
    return any(needle in field.casefold() for field in (node.id, node.model, node.status, node.engine))


def gpu_totals(node: NodeInfo) -> tuple[int, int] | None:
    """GPU memory used and total over the node's devices, in MiB; None when the node reports none."""
    runtime = node.llamacpp_runtime
    if runtime is None or not runtime.gpus:
        return None
    try:
        used = sum(int(gpu["used_mib"]) for gpu in runtime.gpus)
        total = sum(int(gpu["total_mib"]) for gpu in runtime.gpus)
    except (KeyError, TypeError, ValueError):
        return None
    return used, total


def training_context(node: NodeInfo) -> int | None:
    """The model's training context in tokens, from `llamacpp_runtime.effective["train_context"]`."""
    runtime = node.llamacpp_runtime
    value = runtime.effective.get("train_context") if runtime is not None else None
    return value if isinstance(value, int) and value > 0 else None


def devices_of(node: NodeInfo) -> list[DeviceMemory]:
    """The node's devices as the planner's rules want them, built from `llamacpp_runtime.gpus`.

    In CPU mode (`effective.device_mode == "cpu"`) the one device is the host's memory. Records the planner
    would refuse (free above total, negative sizes) are left out.
    """
    runtime = node.llamacpp_runtime
    if runtime is None:
        return []
    cpu = runtime.effective.get("device_mode") == "cpu"
    devices = []
    for gpu in runtime.gpus:
        try:
            index = int(gpu["index"])
            devices.append(
                DeviceMemory(
                    index=index,
                    name="CPU (system memory)" if cpu else str(gpu.get("name") or f"GPU {index}"),
                    total_mib=int(gpu["total_mib"]),
                    free_mib=int(gpu["free_mib"]),
                    kind="cpu" if cpu else "nvidia",
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return devices


def _ttft_key(node: NodeInfo, fleet: Fleet) -> tuple[bool, float]:
    ttft = fleet.ttft_p50_s.get(node.id)
    return (ttft is None, ttft or 0.0)


def _gpu_key(node: NodeInfo, fleet: Fleet) -> tuple[bool, float]:
    totals = gpu_totals(node)
    return (totals is None, totals[0] / totals[1] if totals and totals[1] else 0.0)


def _status_key(node: NodeInfo, fleet: Fleet) -> tuple[int, str]:
    order = STATUS_ORDER.index(node.status) if node.status in STATUS_ORDER else len(STATUS_ORDER)
    return (order, node.status)


@dataclass(frozen=True)
class FleetColumn:
    """One column of the fleet table."""

    key: str
    """The column's key in the table."""
    label: str
    """Its header."""
    width: int
    """Its width in cells at 120 columns and more."""
    compact_width: int
    """Its width in cells on a narrower terminal."""
    sort_key: Callable[[NodeInfo, Fleet], Any]
    """What sorting by this column compares (ties are broken by node id)."""


FLEET_COLUMNS: tuple[FleetColumn, ...] = (
    FleetColumn("id", "Node", 16, 11, lambda n, f: n.id),
    FleetColumn("status", "Status", 15, 11, _status_key),
    FleetColumn("engine", "Engine", 9, 5, lambda n, f: n.engine),
    FleetColumn("model", "Model", 20, 13, lambda n, f: n.model),
    FleetColumn("in_flight", "In-fl", 5, 5, lambda n, f: n.in_flight),
    FleetColumn("breaker", "Breaker", 9, 6, lambda n, f: n.breaker.state),
    FleetColumn("gpu", "GPU memory", 20, 13, _gpu_key),
    FleetColumn("ttft", "TTFT p50", 8, 8, _ttft_key),
    FleetColumn("error", "Last error", 30, 20, lambda n, f: n.last_error or ""),
)
"""The fleet table's columns, left to right; the last one takes the width that is left."""

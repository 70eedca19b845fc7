"""The fleet as the console sees it: nodes by id, their rates, each model's health, and the table's columns.

Pure: no Textual and no I/O. The app feeds it a snapshot (`load`), then events (`apply`) and polls
(`update`, `apply_metrics`); each call answers a `FleetDelta` naming the nodes that changed, so the fleet table
touches only those rows instead of rebuilding itself.

```
fleet = Fleet()
delta = fleet.load(await client.nodes())          # every node changed; unknown ones removed
delta = fleet.apply(event)                        # one NodeEvent from client.events()
delta = fleet.apply_metrics(await client.metrics(), at_s=clock())
fleet.rates.nodes["gpu01"].requests_per_s         # qiip_tui._rates.RateTracker
```
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qiip_core.client import LentHosts, NodeEvent, NodeInfo
from qiip_core.nodes import NodeStatus
from qiip_core.planner import DeviceMemory
from qiip_tui._rates import NodeRates, RateTracker

if TYPE_CHECKING:
    from qiip_core.telemetry import GpuReading

__all__ = [
    "FLEET_COLUMNS",
    "STATUS_ORDER",
    "Fleet",
    "FleetColumn",
    "FleetDelta",
    "ModelSummary",
    "PROBLEM_ORDER",
    "devices_of",
    "gpu_totals",
    "live_readings",
    "matches",
    "on_cpu",
    "shown_devices",
    "slots_of",
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
class ModelSummary:
    """One model across the fleet: `m2 0/1 healthy · 15% errors`."""

    model: str
    """The model name nodes serve."""
    healthy: int
    """Its nodes that are healthy."""
    nodes: int
    """Its nodes."""
    error_ratio: float | None
    """The share of its client requests that failed in the last interval; None without requests."""


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
    """Every node the daemon reported, and the rates the console computed from its metrics."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        """The nodes by id, as last reported."""
        self.rates = RateTracker()
        """Per-node and per-model rates from the daemon's counters, and each node's history."""
        self.lent: LentHosts | None = None
        """The GPU hosts QUADS lends that are not nodes, and the freshness of the daemon's read of QUADS; None
        until a poll read them (or when the client cannot say). They are never nodes: no action reaches them."""

    @property
    def requests_per_s(self) -> float | None:
        """Every client request, per second, between the last two metrics polls; None until two were seen."""
        return self.rates.requests_per_s

    @property
    def ttft_p50_s(self) -> dict[str, float]:
        """Median time to first token by node, in seconds, for the nodes whose streams the daemon timed."""
        return {node_id: r.ttft_p50_s for node_id, r in self.rates.nodes.items() if r.ttft_p50_s is not None}

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
            self.rates.forget(node_id)
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
            self.rates.forget(node.id)
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
        """Take a `client.metrics()` answer: the rates of each node and model since the previous call
        (`RateTracker.read`), and each node's TTFT percentiles.

        Args:
            payload: `{"by_model": {...}, "by_node": {node: {"requests", "failures", "attempts", ...}}}`.
            at_s: when it was read, on the console's clock, in seconds.

        Returns:
            The nodes of the fleet whose rates changed.
        """
        changed = self.rates.read(payload, at_s=at_s)
        changed |= self.rates.mark_idle(self.nodes.keys() - self.rates.nodes.keys())
        return FleetDelta(changed=frozenset(changed & self.nodes.keys()))

    def is_problem(self, node: NodeInfo) -> bool:
        """Whether the node needs an operator's eye: not healthy, its breaker not closed, or failing requests in
        the last interval."""
        if node.status != NodeStatus.HEALTHY or node.breaker.state != "closed":
            return True
        rates = self.rates.nodes.get(node.id)
        return rates is not None and bool(rates.error_ratio)

    def model_summaries(self) -> list[ModelSummary]:
        """Each model's healthy nodes and error ratio, models without a healthy node first, then by error ratio
        (highest first), then by name."""
        healthy: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for node in self.nodes.values():
            total[node.model] += 1
            if node.status == NodeStatus.HEALTHY:
                healthy[node.model] += 1
        summaries = []
        for model, count in total.items():
            rates = self.rates.models.get(model)
            summaries.append(
                ModelSummary(model, healthy[model], count, rates.error_ratio if rates is not None else None)
            )
        return sorted(summaries, key=lambda m: (m.healthy > 0, -(m.error_ratio or 0.0), m.model))

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


def live_readings(node: NodeInfo) -> list[GpuReading]:
    """The node's live GPU readings from `qiip agent` (`gpus_live` in the node view), or none when it has no reading
    or the reading is stale (the agent stopped publishing)."""
    live = node.gpus_live
    return list(live.gpus) if live is not None and not live.stale else []


def shown_devices(node: NodeInfo) -> list[DeviceMemory]:
    """The devices the console shows for a node: its live GPUs where `qiip agent` reports them, else the devices of
    its llama.cpp runtime record (`devices_of`)."""
    live = live_readings(node)
    if not live:
        return devices_of(node)
    return [
        DeviceMemory(
            index=gpu.index,
            name=gpu.name,
            total_mib=gpu.memory_total_mib,
            free_mib=max(gpu.memory_total_mib - gpu.memory_used_mib, 0),
            kind="nvidia",
        )
        for gpu in live
    ]


def gpu_totals(node: NodeInfo) -> tuple[int, int] | None:
    """GPU memory used and total over the node's devices, in MiB: the live readings where `qiip agent` reports
    them, else the llama.cpp runtime record's; None when the node reports neither."""
    live = live_readings(node)
    if live:
        return sum(gpu.memory_used_mib for gpu in live), sum(gpu.memory_total_mib for gpu in live)
    runtime = node.llamacpp_runtime
    if runtime is None or not runtime.gpus:
        return None
    try:
        used = sum(int(gpu["used_mib"]) for gpu in runtime.gpus)
        total = sum(int(gpu["total_mib"]) for gpu in runtime.gpus)
    except (KeyError, TypeError, ValueError):
        return None
    return used, total


def on_cpu(node: NodeInfo) -> bool:
    """Whether the node runs on the CPU (`effective.device_mode == "cpu"`): its memory is the host's RAM."""
    runtime = node.llamacpp_runtime
    return runtime is not None and runtime.effective.get("device_mode") == "cpu" and not live_readings(node)


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


def slots_of(node: NodeInfo) -> tuple[int, int | None]:
    """The node's busy slots and its slots: llama-server's `/slots` as the daemon's probe read it; otherwise
    the requests in flight and the node's concurrency cap (None when it has none)."""
    if node.slots is not None:
        return node.slots.busy, node.slots.total
    return node.in_flight, node.capabilities.concurrency


PROBLEM_ORDER: tuple[str, ...] = (
    NodeStatus.FAILED,
    NodeStatus.RELAUNCH_FAILED,
    NodeStatus.UNHEALTHY,
    NodeStatus.UNKNOWN,
    NodeStatus.PROVISIONING,
    NodeStatus.RELAUNCHING,
    NodeStatus.DRAINING,
    NodeStatus.HEALTHY,
)
"""Statuses from broken to serving: sorting by status puts the nodes that need an operator on top."""


def _status_key(node: NodeInfo, fleet: Fleet) -> tuple[int, bool, float, str]:
    order = PROBLEM_ORDER.index(node.status) if node.status in PROBLEM_ORDER else 0
    rates = fleet.rates.nodes.get(node.id)
    # Among the healthy: an open breaker, then the most failing, first.
    return (order, node.breaker.state == "closed", -((rates.error_ratio or 0.0) if rates else 0.0), node.status)


def _rate_key(read: Callable[[NodeRates], float | None]) -> Callable[[NodeInfo, Fleet], tuple[bool, float]]:
    def key(node: NodeInfo, fleet: Fleet) -> tuple[bool, float]:
        rates = fleet.rates.nodes.get(node.id)
        value = read(rates) if rates is not None else None
        return (value is None, value or 0.0)

    return key


def _slots_key(node: NodeInfo, fleet: Fleet) -> tuple[float, int]:
    busy, total = slots_of(node)
    return (busy / total if total else 0.0, busy)


def _gpu_key(node: NodeInfo, fleet: Fleet) -> tuple[bool, float]:
    totals = gpu_totals(node)
    return (totals is None, totals[0] / totals[1] if totals and totals[1] else 0.0)


@dataclass(frozen=True)
class FleetColumn:
    """One column of the fleet table: sized to its content between `min_width` and `max_width`."""

    key: str
    """The column's key in the table."""
    label: str
    """Its header (the sort marker is added after it)."""
    sort_key: Callable[[NodeInfo, Fleet], Any]
    """What sorting by this column compares (ties are broken by node id)."""
    min_width: int = 3
    """Its narrowest width in cells."""
    max_width: int = 24
    """Its widest width in cells; longer cells are cut."""


FLEET_COLUMNS: tuple[FleetColumn, ...] = (
    FleetColumn("id", "Node", lambda n, f: n.id, max_width=28),
    FleetColumn("status", "Status", _status_key),
    FleetColumn("model", "Model", lambda n, f: n.model, max_width=28),
    FleetColumn("rps", "Req/s", _rate_key(lambda r: r.requests_per_s)),
    FleetColumn("errors", "Err%", _rate_key(lambda r: r.error_ratio)),
    FleetColumn("retries", "Retry/s", _rate_key(lambda r: r.retries_per_s)),
    FleetColumn("slots", "Slots", _slots_key),
    FleetColumn("ttft", "TTFT p50", _rate_key(lambda r: r.ttft_p50_s)),
    FleetColumn("breaker", "Breaker", lambda n, f: n.breaker.state),
    FleetColumn("gpu", "Memory", _gpu_key, min_width=18, max_width=18),
    FleetColumn("engine", "Engine", lambda n, f: n.engine, max_width=9),
    FleetColumn("error", "Last error", lambda n, f: n.last_error or "", min_width=24, max_width=10_000),
)
"""The fleet table's columns, left to right: what needs attention first; the last takes the width that is left."""

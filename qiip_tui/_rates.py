"""Rates from the daemon's counters: what each node and model did between two reads of `/admin/metrics`.

Pure: no Textual and no I/O. `/admin/metrics` gives totals since the daemon started; a rate is the growth of a
total between two reads divided by the time between them (as Prometheus' `rate()` does, without the
extrapolation). A total that went down means the daemon restarted: that read starts the measurement again.

```
tracker = RateTracker()
tracker.read(payload, at_s=clock())       # the first read gives no rates
tracker.read(payload, at_s=clock())       # -> tracker.nodes["gpu01"].requests_per_s, …
tracker.history["gpu01"]                  # the last HISTORY_SAMPLES readings, oldest first
```
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HISTORY_SAMPLES", "ModelRates", "NodeRates", "RateTracker"]

HISTORY_SAMPLES = 60
"""Readings kept per node for the sparklines: five minutes at the console's default poll interval (5 s)."""

ERROR_WINDOW_S = 60.0
"""The error ratios are over the last minute of reads, not one interval: a few failures stay in sight for a
minute instead of flickering for one poll."""


@dataclass(frozen=True)
class NodeRates:
    """What one node did between two reads."""

    requests_per_s: float
    """Client requests it answered, per second."""
    error_ratio: float | None
    """Its failed attempts over its attempts (0..1) in the last `ERROR_WINDOW_S`; None when it had none."""
    retries_per_s: float
    """Attempts that failed on it and were sent to another node, per second."""
    tokens_per_s: float
    """Completion tokens it generated, per second (as its answers' `usage` reported them)."""
    ttft_p50_s: float | None = None
    """Median time to first token of its recent streams, seconds (the daemon's `ttft_p50_s`)."""
    ttft_p95_s: float | None = None
    """95th percentile of the same, seconds (`ttft_p95_s`)."""


@dataclass(frozen=True)
class ModelRates:
    """What the clients of one model saw between two reads."""

    requests_per_s: float
    """Client requests for the model, per second."""
    error_ratio: float | None
    """The share of its requests that failed (0..1) in the last `ERROR_WINDOW_S`; None when there were none."""


def _number(counts: Mapping[str, Any], key: str) -> float | None:
    value = counts.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _ratio(part: float, whole: float) -> float | None:
    return min(max(part / whole, 0.0), 1.0) if whole > 0 else None


class RateTracker:
    """The latest rates of every node and model, and each node's recent history."""

    def __init__(self, *, history_samples: int = HISTORY_SAMPLES) -> None:
        self.history_samples = history_samples
        self.nodes: dict[str, NodeRates] = {}
        """The rates of the last interval, by node."""
        self.models: dict[str, ModelRates] = {}
        """The rates of the last interval, by model."""
        self.history: dict[str, deque[NodeRates]] = {}
        """Each node's readings, oldest first, at most `history_samples`."""
        self.requests_per_s: float | None = None
        """Every client request, per second; None until two reads were seen."""
        self._previous: tuple[float, Mapping[str, Any]] | None = None
        self._window: deque[tuple[float, Mapping[str, Any]]] = deque()

    def read(self, payload: Mapping[str, Any], *, at_s: float) -> set[str]:
        """Take one `/admin/metrics` answer.

        Args:
            payload: `{"by_model": {model: counts}, "by_node": {node: counts}}` (see the daemon's
                `GatewayMetrics.snapshot`).
            at_s: when it was read, on a monotonic clock, in seconds.

        Returns:
            The nodes whose rates changed.
        """
        previous, self._previous = self._previous, (at_s, payload)
        window = self._window
        while len(window) > 1 and window[1][0] <= at_s - ERROR_WINDOW_S:
            window.popleft()
        oldest = window[0] if window else None
        window.append((at_s, payload))
        by_node: Mapping[str, Any] = payload.get("by_node") or {}
        by_model: Mapping[str, Any] = payload.get("by_model") or {}
        # Nodes the daemon no longer counts (it restarted, or they left): their rates are unknown now.
        changed: set[str] = {node_id for node_id in self.nodes if node_id not in by_node}
        for node_id in changed:
            del self.nodes[node_id]
        if previous is None or at_s <= previous[0]:
            # No interval yet: only the TTFT percentiles, which are not rates.
            for node_id, counts in by_node.items():
                changed |= self._set(node_id, NodeRates(0.0, None, 0.0, 0.0, *_ttft(counts)), record=False)
            return changed
        elapsed = at_s - previous[0]
        before_nodes: Mapping[str, Any] = previous[1].get("by_node") or {}
        before_models: Mapping[str, Any] = previous[1].get("by_model") or {}
        assert oldest is not None  # the previous read is in the window
        oldest_nodes: Mapping[str, Any] = oldest[1].get("by_node") or {}
        oldest_models: Mapping[str, Any] = oldest[1].get("by_model") or {}
        total = sum(_number(c, "requests") or 0.0 for c in (by_model or by_node).values())
        total_before = sum(_number(c, "requests") or 0.0 for c in (before_models or before_nodes).values())
        self.requests_per_s = (total - total_before) / elapsed if total >= total_before else None
        for node_id, counts in by_node.items():
            growth = _growth(counts, before_nodes.get(node_id) or {})
            if growth is None:
                if self.nodes.pop(node_id, None) is not None:
                    changed.add(node_id)
                continue
            # Over the window; over the interval when a counter went down within it (the daemon restarted).
            windowed = _growth(counts, oldest_nodes.get(node_id) or {}) or growth
            rates = NodeRates(
                requests_per_s=growth["requests"] / elapsed,
                error_ratio=_ratio(windowed["failures"], windowed["attempts"]),
                retries_per_s=growth["retries"] / elapsed,
                tokens_per_s=growth["completion_tokens"] / elapsed,
                ttft_p50_s=_ttft(counts)[0],
                ttft_p95_s=_ttft(counts)[1],
            )
            changed |= self._set(node_id, rates, record=True)
        models = {}
        for model, counts in by_model.items():
            growth = _growth(counts, before_models.get(model) or {})
            if growth is not None:
                windowed = _growth(counts, oldest_models.get(model) or {}) or growth
                models[model] = ModelRates(
                    growth["requests"] / elapsed, _ratio(windowed["errors"], windowed["requests"])
                )
        self.models = models
        return changed

    def _set(self, node_id: str, rates: NodeRates, *, record: bool) -> set[str]:
        if record:
            history = self.history.get(node_id)
            if history is None:
                history = self.history[node_id] = deque(maxlen=self.history_samples)
            history.append(rates)
        if self.nodes.get(node_id) == rates:
            return set()
        self.nodes[node_id] = rates
        return {node_id}

    def mark_idle(self, node_ids: Iterable[str]) -> set[str]:
        """Give zero rates to nodes the daemon has no counts of yet (no request ever reached them), once an
        interval was measured: they are idle, not unknown.

        Returns:
            The nodes whose rates changed.
        """
        if self.requests_per_s is None:
            return set()
        changed: set[str] = set()
        for node_id in node_ids:
            if node_id not in self.nodes:
                changed |= self._set(node_id, NodeRates(0.0, None, 0.0, 0.0), record=True)
        return changed

    def forget(self, node_id: str) -> None:
        """Drop a node that left the fleet."""
        self.nodes.pop(node_id, None)
        self.history.pop(node_id, None)


_KEYS = ("requests", "errors", "retries", "failures", "attempts", "completion_tokens")


def _growth(now: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, float] | None:
    """Each counter's growth; None when one went down (the daemon restarted between the reads). A counter that
    is missing or not a number counts as 0."""
    growth = {}
    for key in _KEYS:
        value, old = now.get(key, 0.0), before.get(key, 0.0)
        if not isinstance(value, int | float) or not math.isfinite(value):
            value = 0.0
        if not isinstance(old, int | float) or not math.isfinite(old):
            old = 0.0
        if value < old:
            return None
        growth[key] = value - old
    if not _number(now, "attempts"):
        # A daemon without the `attempts` series: its answered requests are its attempts.
        growth["attempts"] = growth["requests"] + growth["failures"]
    return growth


def _ttft(counts: Mapping[str, Any]) -> tuple[float | None, float | None]:
    return _number(counts, "ttft_p50_s"), _number(counts, "ttft_p95_s")

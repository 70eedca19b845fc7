"""The last step of an inference request: account. Prometheus metrics of the client API (`GET /metrics`).

Every inference request ends as one `Outcome`, filled in as it goes and accounted once, when it ends
(`GatewayMetrics.account`); per-node gauges (in-flight requests, status, breaker) are read from the routing
table when Prometheus scrapes, so the request path never touches a gauge.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from qiip_core.nodes import NodeStatus
from qiip_core.routing import RoutingTable

__all__ = ["GatewayMetrics", "Outcome"]

TTFT_WINDOW = 256
"""How many recent streaming requests per node the admin metrics' `ttft_p50_s` is the median of."""

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class Outcome:
    """How one client request ended, as the metrics record it.

    Attributes:
        started: when the request arrived (`time.perf_counter()`, seconds).
        model: the requested model ("" before it is known, and for a model no node serves).
        node: the node that answered ("" when none did).
        status: the HTTP status the client got (499 when it left first); None while the request has not
            ended for the client, and for a request the daemon stopped before it had an answer (not
            accounted).
        duration_s: time to the last byte, in seconds.
        ttft_s: time to the first event of a stream, in seconds.
        error_code: the OpenAI error code when the request failed (also mid-stream), else None.
        failed_nodes: nodes whose attempts failed before this answer.
    """

    started: float
    model: str = ""
    node: str = ""
    status: int | None = None
    duration_s: float = 0.0
    ttft_s: float | None = None
    error_code: str | None = None
    failed_nodes: Sequence[str] = ()


class _TableCollector(Collector):
    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "qiip_in_flight_requests", "Requests in flight per node.", labels=["model", "node"]
        )
        up = GaugeMetricFamily(
            "qiip_node_status", "1 for the node's current status, per status.", labels=["node", "status"]
        )
        breaker = GaugeMetricFamily(
            "qiip_node_breaker_open",
            "1 when the node's circuit breaker is open or half-open.",
            labels=["node"],
        )
        for state in self._table:
            in_flight.add_metric([state.node.model, state.id], state.in_flight)
            for status in NodeStatus:
                up.add_metric([state.id, status.value], 1.0 if state.status is status else 0.0)
            breaker.add_metric([state.id], 1.0 if state.breaker.is_open else 0.0)
        yield in_flight
        yield up
        yield breaker


class GatewayMetrics:
    """The daemon's metrics, in a registry of its own (one per app, so tests can run several).

    Args:
        table: the routing table, read at scrape time for per-node gauges.
    """

    def __init__(self, table: RoutingTable) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "qiip_requests",
            "Client requests by model, serving node (empty when none) and HTTP status.",
            ["model", "node", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "qiip_request_errors",
            "Failed client requests by model, node and error code.",
            ["model", "node", "code"],
            registry=self.registry,
        )
        self.retries = Counter(
            "qiip_upstream_retries",
            "Attempts that failed and were retried on another node, by the node that failed.",
            ["model", "node"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "qiip_time_to_first_token_seconds",
            "Streaming requests: time from the request to its first event reaching the client.",
            ["model", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "qiip_request_duration_seconds",
            "Client requests: time from the request to the last byte of the response.",
            ["model", "node"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_TableCollector(table))
        self._recent_ttft_s: dict[str, deque[float]] = {}

    def snapshot(self) -> dict[str, Any]:
        """Request counters as JSON: `{"by_model": {model: counts}, "by_node": {node: counts}}`, where counts
        are `requests`, `errors` and `retries`; a node's counts also carry `ttft_p50_s`, the median time to
        first token in seconds of its last `TTFT_WINDOW` streaming requests, once it has served one."""
        by_model: dict[str, dict[str, float]] = {}
        by_node: dict[str, dict[str, float]] = {}

        def add(labels: dict[str, str], key: str, value: float) -> None:
            for group, name in ((by_model, labels.get("model", "")), (by_node, labels.get("node", ""))):
                if name:
                    counts = group.setdefault(name, {"requests": 0, "errors": 0, "retries": 0})
                    counts[key] += value

        for metric, key in ((self.requests, "requests"), (self.errors, "errors"), (self.retries, "retries")):
            for family in metric.collect():
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        add(sample.labels, key, sample.value)
        for node, recent in self._recent_ttft_s.items():
            if recent and node in by_node:
                by_node[node]["ttft_p50_s"] = statistics.median(recent)
        return {"by_model": by_model, "by_node": by_node}

    def account(self, outcome: Outcome) -> None:
        """Record one finished client request: its count by status, its error, the nodes that failed before
        the answer, and (when a node answered) its latency and time to first token.

        Args:
            outcome: how the request ended; one without a status (the daemon stopped it before it had an
                answer) is not recorded.
        """
        if outcome.status is None:
            return
        model, node = outcome.model, outcome.node
        self.requests.labels(model, node, str(outcome.status)).inc()
        if outcome.error_code is not None:
            self.errors.labels(model, node, outcome.error_code).inc()
        for failed in outcome.failed_nodes:
            self.retries.labels(model, failed).inc()
        if node:
            self.latency.labels(model, node).observe(outcome.duration_s)
            ttft_s = outcome.ttft_s
            if ttft_s is not None:
                self.ttft.labels(model, node).observe(ttft_s)
                recent = self._recent_ttft_s.get(node)
                if recent is None:
                    recent = self._recent_ttft_s[node] = deque(maxlen=TTFT_WINDOW)
                recent.append(ttft_s)

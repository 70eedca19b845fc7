"""The routing engine: least-connections selection, reservations, circuit breakers, forwarding with
failover before the first byte, and SSE framing for the relay."""

from __future__ import annotations

from qiip_core.routing._breaker import BreakerState, CircuitBreaker
from qiip_core.routing._forward import (
    HOP_BY_HOP_HEADERS,
    Forwarder,
    UpstreamClient,
    UpstreamRequest,
    UpstreamResponse,
    map_transport_error,
)
from qiip_core.routing._sse import EventFramer, event_boundary
from qiip_core.routing._table import (
    ChangeKind,
    NodeState,
    Reservation,
    RoutingTable,
    TableChange,
    select_least_connections,
)

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "BreakerState",
    "ChangeKind",
    "CircuitBreaker",
    "EventFramer",
    "Forwarder",
    "NodeState",
    "Reservation",
    "RoutingTable",
    "TableChange",
    "UpstreamClient",
    "UpstreamRequest",
    "UpstreamResponse",
    "event_boundary",
    "map_transport_error",
    "select_least_connections",
]

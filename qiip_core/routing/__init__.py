"""The routing engine: least-connections selection or prefix affinity, reservations, circuit breakers,
forwarding with failover before the first byte, and the node's answer as the relay reads it (SSE framing
included).

In the order a request takes them: `_admission` (admit or shed: `Admission.admit`), `_affinity` (the prefix
map, consulted by the table), `_table` (select: `RoutingTable.reserve`), `_upstream` (the client, the request it
sends, and its errors translated), `_forward` (`Forwarder.open`: attempts and failover), `_response` (the
committed answer: reading, and the node's success or failure), `_sse` (event framing). `_board` counts requests
in flight over the daemon's serving processes (`server.workers`).
"""

from __future__ import annotations

from qiip_core.routing._admission import Admission, AdmissionBound
from qiip_core.routing._affinity import (
    MAX_BLOCKS,
    PROMPT_BLOCK_CHARS,
    PROMPT_BLOCK_TOKENS,
    RECORDED_BLOCKS,
    SAMPLED_MESSAGE_CHARS,
    AffinityResult,
    PrefixAffinity,
    RoutingPolicy,
    prefix_hashes,
)
from qiip_core.routing._board import DEFAULT_COLUMNS, ColumnMap, InFlightBoard
from qiip_core.routing._breaker import BreakerPolicy, BreakerState, CircuitBreaker
from qiip_core.routing._forward import Forwarder
from qiip_core.routing._response import HOP_BY_HOP_HEADERS, UpstreamResponse
from qiip_core.routing._sse import EventFramer, event_boundary
from qiip_core.routing._state import RECENT_ERRORS, NodeError
from qiip_core.routing._table import (
    ChangeKind,
    ExpectedModel,
    NodeState,
    Reservation,
    RoutingTable,
    TableChange,
    select_least_connections,
)
from qiip_core.routing._upstream import (
    AllowlistResolver,
    UpstreamClient,
    UpstreamRequest,
    describe_client_error,
    is_local_exhaustion,
    map_transport_error,
)

__all__ = [
    "DEFAULT_COLUMNS",
    "HOP_BY_HOP_HEADERS",
    "MAX_BLOCKS",
    "PROMPT_BLOCK_CHARS",
    "PROMPT_BLOCK_TOKENS",
    "RECENT_ERRORS",
    "RECORDED_BLOCKS",
    "SAMPLED_MESSAGE_CHARS",
    "Admission",
    "AdmissionBound",
    "AffinityResult",
    "AllowlistResolver",
    "BreakerPolicy",
    "BreakerState",
    "ChangeKind",
    "CircuitBreaker",
    "ColumnMap",
    "EventFramer",
    "ExpectedModel",
    "Forwarder",
    "InFlightBoard",
    "NodeError",
    "NodeState",
    "PrefixAffinity",
    "Reservation",
    "RoutingPolicy",
    "RoutingTable",
    "TableChange",
    "UpstreamClient",
    "UpstreamRequest",
    "UpstreamResponse",
    "describe_client_error",
    "event_boundary",
    "is_local_exhaustion",
    "map_transport_error",
    "prefix_hashes",
    "select_least_connections",
]

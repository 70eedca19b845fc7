"""The routing engine: where a request goes. Least-connections selection or prefix affinity, reservations,
circuit breakers, and forwarding with failover before the first byte.

In the order a request takes them: `_admission` (admit or shed: `Admission.admit`), `_affinity` (the prefix
map, consulted by the table), `_table` (select: `RoutingTable.reserve`, which hands out a `_reservation`),
`_forward` (`Forwarder.open`: attempts and failover, sending through `qiip_core.upstream`). `_board` counts
requests in flight over the daemon's serving processes (`server.workers`).
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
from qiip_core.routing._reservation import Reservation
from qiip_core.routing._state import RECENT_ERRORS, NodeError
from qiip_core.routing._table import (
    ChangeKind,
    ExpectedModel,
    NodeState,
    RoutingTable,
    TableChange,
    select_least_connections,
)

__all__ = [
    "DEFAULT_COLUMNS",
    "MAX_BLOCKS",
    "PROMPT_BLOCK_CHARS",
    "PROMPT_BLOCK_TOKENS",
    "RECENT_ERRORS",
    "RECORDED_BLOCKS",
    "SAMPLED_MESSAGE_CHARS",
    "Admission",
    "AdmissionBound",
    "AffinityResult",
    "BreakerPolicy",
    "BreakerState",
    "ChangeKind",
    "CircuitBreaker",
    "ColumnMap",
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
    "prefix_hashes",
    "select_least_connections",
]

"""The fleet journal: a bounded, in-memory timeline of what happened to each node, with when and why.

The routing table and the operation runner already say what changes; the journal listens to both and keeps
one line per event an operator asks about:

| event | when | reason |
|---|---|---|
| `added`, `removed` | a node enters or leaves the table | where it came from; the operation that removed it |
| `status` | its effective status changes (`from` → `to`) | the probe's outcome; the operation behind a lifecycle |
| `breaker_open`, `breaker_closed` | its circuit breaker opens or closes | the failure that opened it; what closed it |
| `operation_started`, `operation_<state>` | an operation (drain, remove, relaunch…) starts, ends | result, error |
| `note` | the daemon records something itself (an operator's undrain) | as given |

Only the last `JOURNAL_ENTRIES` (2,000) entries are kept, oldest dropped first, and a follower that stops
reading loses entries rather than growing memory. The journal lives and dies with the daemon: it is not
persisted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from qiip_core.lifecycle import Operation, OperationRunner, OperationState
from qiip_core.nodes import NodeStatus
from qiip_core.routing import BreakerState, ChangeKind, RoutingTable, TableChange

__all__ = ["JOURNAL_ENTRIES", "Journal", "JournalEntry"]

logger = logging.getLogger("qiip.journal")

JOURNAL_ENTRIES = 2_000
"""Entries the journal keeps; older ones are dropped first."""

_FOLLOWER_QUEUE = 1_024


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One event of the journal.

    Attributes:
        seq: its number, increasing from 1 since the daemon started: a follower sees gaps as missing numbers.
        at: when it happened (UTC).
        node: the node (or host) it is about.
        event: what happened: `added`, `removed`, `status`, `breaker_open`, `breaker_closed`, `operation_started`,
            `operation_succeeded`, `operation_failed`, `operation_cancelled`, `note`.
        summary: what happened, as one line an operator reads (`healthy → unhealthy`, `drain started`).
        reason: why, when known (`3 failed health probes: …`, `drain operation op_…`).
        data: the event's fields: `from` and `to` for a status, `operation`, `kind` and `state` for operations.
    """

    seq: int
    at: datetime
    node: str
    event: str
    summary: str
    reason: str | None = None
    data: dict[str, Any] | None = None

    def view(self) -> dict[str, Any]:
        """The entry as JSON for the admin API: `{seq, at, node, event, summary, reason, …data}`."""
        return {
            "seq": self.seq,
            "at": self.at.isoformat(),
            "node": self.node,
            "event": self.event,
            "summary": self.summary,
            "reason": self.reason,
            **(self.data or {}),
        }


class Journal:
    """The fleet's timeline, fed by the routing table and the operation runner.

    Args:
        table: the routing table to listen to.
        operations: the operation runner to listen to (drains, removals, relaunches, setups, teardowns).
        max_entries: entries kept (`JOURNAL_ENTRIES`).
    """

    def __init__(self, table: RoutingTable, operations: OperationRunner, *, max_entries: int = JOURNAL_ENTRIES) -> None:
        self._table = table
        self._entries: collections.deque[JournalEntry] = collections.deque(maxlen=max_entries)
        self._seq = itertools.count(1)
        self._followers: set[asyncio.Queue[JournalEntry | None]] = set()
        # What each node last looked like to the journal, so an update says what changed.
        self._status: dict[str, NodeStatus] = {}
        self._breaker: dict[str, BreakerState] = {}
        # The operation running on each node: the reason behind the lifecycle changes it makes.
        self._running: dict[str, Operation] = {}
        self._unsubscribe = table.add_listener(self._on_change)
        operations.add_listener(self._on_operation)

    # -- reading -------------------------------------------------------------------------------------------

    def entries(self) -> list[JournalEntry]:
        """Every entry kept, oldest first."""
        return list(self._entries)

    @contextlib.contextmanager
    def follow(self) -> Iterator[tuple[list[JournalEntry], asyncio.Queue[JournalEntry | None]]]:
        """Follow the journal: the entries kept now, and a queue of every later one.

        Yields:
            `(backlog, queue)`; the queue receives each new entry, and None when the journal is closed
            (`close`). A follower more than 1,024 entries behind loses the oldest of them.
        """
        queue: asyncio.Queue[JournalEntry | None] = asyncio.Queue(maxsize=_FOLLOWER_QUEUE)
        self._followers.add(queue)
        try:
            yield list(self._entries), queue
        finally:
            self._followers.discard(queue)

    def close(self) -> None:
        """End every follower (the daemon is shutting down) and stop listening to the table."""
        self._unsubscribe()
        for queue in self._followers:
            _put(queue, None)

    # -- writing -------------------------------------------------------------------------------------------

    def record(self, node: str, event: str, summary: str, reason: str | None = None, **data: Any) -> JournalEntry:
        """Add an entry now and hand it to every follower.

        Args:
            node: the node or host it is about.
            event: what happened (see `JournalEntry.event`; `note` for anything else).
            summary: one line an operator reads.
            reason: why, when known.
            data: extra JSON fields.
        """
        entry = JournalEntry(next(self._seq), datetime.now(UTC), node, event, summary, reason, data or None)
        self._entries.append(entry)
        for queue in self._followers:
            _put(queue, entry)
        return entry

    def _operation_reason(self, node_id: str) -> str | None:
        operation = self._running.get(node_id)
        return f"{operation.kind} operation {operation.id}" if operation is not None else None

    def _on_change(self, change: TableChange) -> None:
        node = change.node
        state = self._table.get(node.id)
        if change.kind is ChangeKind.ADDED:
            self._status[node.id] = node.status
            self._breaker[node.id] = state.breaker.state if state is not None else BreakerState.CLOSED
            source = state.source if state is not None else "the registry"
            self.record(
                node.id, "added", f"added as {node.status.value}", f"registered from {source}", to=node.status.value
            )
            return
        if change.kind is ChangeKind.REMOVED:
            self._status.pop(node.id, None)
            self._breaker.pop(node.id, None)
            why = self._operation_reason(node.id) or "deregistered"
            self.record(node.id, "removed", "removed from the fleet", why)
            return
        before = self._status.get(node.id)
        if before is not node.status:
            self._status[node.id] = node.status
            lifecycle_change = node.status not in _LIVENESS or (before is not None and before not in _LIVENESS)
            reason: str | None = change.reason
            if lifecycle_change or reason is None:
                reason = self._operation_reason(node.id) or reason or "set through the registry"
            shown = before.value if before is not None else "unknown"
            self.record(
                node.id, "status", f"{shown} → {node.status.value}", reason, **{"from": shown, "to": node.status.value}
            )
        if state is not None:
            breaker = state.breaker.state
            was = self._breaker.get(node.id, BreakerState.CLOSED)
            self._breaker[node.id] = breaker
            if breaker is BreakerState.OPEN and was is BreakerState.CLOSED:
                self.record(node.id, "breaker_open", "circuit breaker opened", change.reason or state.last_error)
            elif breaker is BreakerState.CLOSED and was is not BreakerState.CLOSED:
                self.record(node.id, "breaker_closed", "circuit breaker closed", change.reason)

    def _on_operation(self, operation: Operation) -> None:
        fields = {"operation": operation.id, "kind": operation.kind, "state": operation.state.value}
        if operation.state is OperationState.RUNNING:
            self._running[operation.node_id] = operation
            self.record(operation.node_id, "operation_started", f"{operation.kind} started", None, **fields)
            return
        if self._running.get(operation.node_id) is operation:
            del self._running[operation.node_id]
        reason = operation.error if operation.error else _describe_result(operation.result)
        self.record(
            operation.node_id,
            f"operation_{operation.state.value}",
            f"{operation.kind} {operation.state.value}",
            reason,
            **fields,
        )


_LIVENESS = frozenset({NodeStatus.HEALTHY, NodeStatus.UNHEALTHY, NodeStatus.UNKNOWN})


def _describe_result(result: dict[str, Any]) -> str | None:
    """An operation's result as one line: `in_flight=0, drained=True`."""
    if not result:
        return None
    return ", ".join(f"{key}={value}" for key, value in result.items() if not isinstance(value, dict | list))[:300]


def _put(queue: asyncio.Queue[JournalEntry | None], item: JournalEntry | None) -> None:
    if queue.full():
        # A follower that stopped reading gets a gap rather than unbounded memory.
        queue.get_nowait()
    queue.put_nowait(item)

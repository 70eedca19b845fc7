"""One request's claim on one node (`Reservation`): taken by `RoutingTable.reserve`, released exactly once.

The reservation reports the request's outcome and its release to the table that made it, typed here as the
`Ledger` it uses, so this module needs nothing of the table's.
"""

from __future__ import annotations

import time
from typing import Protocol

from qiip_core.nodes import Node
from qiip_core.routing._state import NodeState

__all__ = ["Ledger", "Reservation"]


class Ledger(Protocol):
    """What a reservation reports to: the routing table that made it."""

    def record_success(self, node_id: str) -> None:
        """The request succeeded on the node."""

    def record_failure(self, node_id: str, error: str, *, started_at: float | None = None, noted: bool = False) -> bool:
        """The request failed on the node; True when its breaker is open after it."""

    def _release(self, state: NodeState) -> None:
        """The request's slot on the node is given back."""


class Reservation:
    """One request's claim on one node. `release()` is idempotent; the table counts it exactly once. A
    committed response reports the node's outcome to it (it is the response's `OutcomeSink`).

    Use it as a context manager, or call `release()` in a `finally`.

    Attributes:
        state: the node.
        started_at: when it was reserved (`time.monotonic()` seconds): failures of requests sent before the
            node's last counted failure are the same signal (`CircuitBreaker.record_failure`).
        trial: this request is the node's breaker trial; released without an outcome, the trial is given
            back.
    """

    __slots__ = ("_released", "_table", "started_at", "state", "trial")

    def __init__(self, table: Ledger, state: NodeState, *, trial: bool = False) -> None:
        self._table = table
        self.state = state
        self.started_at = time.monotonic()
        self.trial = trial
        self._released = False

    @property
    def node(self) -> Node:
        """The reserved node's registration."""
        return self.state.node

    @property
    def node_id(self) -> str:
        """The reserved node's id."""
        return self.state.id

    @property
    def health_failures(self) -> int:
        """The reserved node's consecutive failed health probes (0 while it passes them)."""
        return self.state.health_failures

    @property
    def released(self) -> bool:
        """True once released."""
        return self._released

    def record_success(self) -> None:
        """The request succeeded on this node: its breaker closes (`RoutingTable.record_success`)."""
        self._table.record_success(self.state.id)

    def record_failure(self, error: str, *, noted: bool = False) -> bool:
        """The request failed on this node with a connect error, timeout or broken answer
        (`RoutingTable.record_failure`).

        Args:
            error: what went wrong, for operators.
            noted: the failure is in the node's error record already (`note_error`).

        Returns:
            True when the failure opened (or kept open) the node's breaker.
        """
        return self._table.record_failure(self.state.id, error, started_at=self.started_at, noted=noted)

    def note_error(self, error: str, *, status: int | None = None) -> None:
        """Keep a failure of this request in the node's error record, without counting it against the node's
        breaker (`NodeState.note_error`)."""
        self.state.note_error(error, status=status)

    def release(self) -> None:
        """Give the slot back (and an unfinished breaker trial). Calling it again does nothing."""
        if not self._released:
            self._released = True
            if self.trial:
                self.state.breaker.reopen()
            self._table._release(self.state)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

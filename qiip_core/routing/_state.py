"""A node as the routing table holds it (`NodeState`), its record of recent errors (`NodeError`), and
least-connections selection among nodes."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from qiip_core.nodes import LIFECYCLE_STATUSES, Node, NodeStatus, ResidentModel
from qiip_core.routing._board import InFlightBoard
from qiip_core.routing._breaker import BreakerPolicy, BreakerState, CircuitBreaker

__all__ = ["RECENT_ERRORS", "NodeError", "NodeState", "select_least_connections"]

RECENT_ERRORS = 20
"""Errors a node keeps (`NodeState.recent_errors`); the same error seen again in a row counts, and takes no room."""


@dataclass(frozen=True, slots=True)
class NodeError:
    """One failure seen on a node: a failed attempt of a request (whether or not another node then answered it),
    a stream the node broke off, or a failed health probe.

    Attributes:
        at: when it was last seen (UTC).
        first_at: when the first of the `count` in a row was seen (UTC).
        message: what happened, as the daemon logs it: the gateway's words with what the node or the transport
            said, secrets redacted and control characters escaped (`UpstreamError.log_text`).
        status: the node's HTTP status (a 5xx answer); None for a transport error, a timeout or a probe.
        count: times it was seen in a row, up to `at`.
    """

    at: datetime
    first_at: datetime
    message: str
    status: int | None = None
    count: int = 1

    def view(self) -> dict[str, object]:
        """The error as the admin API shows it (`recent_errors[]` of a node)."""
        return {
            "at": self.at.isoformat(),
            "first_at": self.first_at.isoformat(),
            "status": self.status,
            "error": self.message,
            "count": self.count,
        }


class NodeState:
    """A node in the routing table: its registration plus what this gateway observes.

    Attributes:
        node: the registration record, as the registry last gave it.
        lifecycle: a lifecycle status (draining, provisioning, …) from the registry, or None.
        liveness: healthy, unhealthy or unknown: observed by this gateway, or the registry's until then.
        in_flight: requests currently reserved on the node: by every serving process when the table counts on
            a shared board (`server.workers`), else by this one.
        breaker: the node's circuit breaker.
        health_failures: consecutive failed health probes.
        observed: True once this gateway has probed the node itself.
        last_error: the last failure seen (probe or request), for operators.
        last_error_at: when `last_error` was seen (UTC).
        recent_errors: the last `RECENT_ERRORS` failures, oldest first (`NodeError`).
        last_probe_at: when the last health probe finished (UTC).
        slots: llama-server's slots as its last probe read them (`GET /slots`): busy and total; None when the
            node is not a llama.cpp node or does not expose them.
        resident: an Ollama node's model as its server holds it in memory, per its last probe (`GET /api/ps`): one
            entry, or none when it is not loaded; None
            when the node is not an Ollama node or has not answered it yet.
        removed: deleted from the registry; leaves the table when `in_flight` reaches 0.
        source: where the registration came from (`config`, `state`, `local`, `etcd`).
    """

    __slots__ = (
        "_board",
        "_column",
        "_local",
        "breaker",
        "health_failures",
        "id",
        "last_error",
        "last_error_at",
        "last_probe_at",
        "lifecycle",
        "liveness",
        "node",
        "observed",
        "recent_errors",
        "removed",
        "resident",
        "slots",
        "source",
    )

    def __init__(self, node: Node, *, source: str, breaker: BreakerPolicy) -> None:
        self.node = node
        self.id: str = node.id
        """The node id (a state is the one of its id for good: a registration of the same id replaces `node`)."""
        self.lifecycle: NodeStatus | None = node.status if node.status in LIFECYCLE_STATUSES else None
        self.liveness = NodeStatus.UNKNOWN if self.lifecycle else node.status
        self._local = 0
        self._board: InFlightBoard | None = None
        self._column = -1
        self.breaker = CircuitBreaker(breaker)
        self.health_failures = 0
        self.observed = False
        self.last_error: str | None = None
        self.last_error_at: datetime | None = None
        self.recent_errors: deque[NodeError] = deque(maxlen=RECENT_ERRORS)
        self.last_probe_at: datetime | None = None
        self.slots: tuple[int, int] | None = None
        self.resident: tuple[ResidentModel, ...] | None = None
        self.removed = False
        self.source = source

    @property
    def in_flight(self) -> int:
        """Requests reserved on the node: over every serving process on a shared board, else by this one."""
        board = self._board
        return self._local if board is None else board.total(self._column)

    @property
    def column(self) -> int | None:
        """The board column the node's requests are counted in, or None (this process alone)."""
        return self._column if self._board is not None else None

    def add_in_flight(self, delta: int) -> None:
        """Count `delta` more (or, negative, fewer) requests of this process on the node."""
        self._local += delta
        if self._board is not None:
            self._board.put(self._column, self._local)

    def count_on(self, board: InFlightBoard | None, column: int | None) -> None:
        """Count the node's requests in `column` of `board` from now on; without either, in this process alone."""
        if self._board is not None:
            self._board.put(self._column, 0)
        if board is None or column is None:
            self._board, self._column = None, -1
            return
        self._board, self._column = board, column
        board.put(column, self._local)

    def note_error(self, error: str | None, *, status: int | None = None) -> None:
        """Record a failure seen on the node now: its last error, and one more of its recent errors (the same
        error as the newest counts in it); None forgets the last error and keeps the record.

        Args:
            error: what happened, already sanitized (`UpstreamError.log_text`, a probe's description).
            status: the node's HTTP status when it answered with an error; None otherwise.
        """
        now = datetime.now(UTC)
        self.last_error = error
        self.last_error_at = now if error is not None else None
        if error is None:
            return
        errors = self.recent_errors
        newest = errors[-1] if errors else None
        if newest is not None and newest.message == error and newest.status == status:
            errors[-1] = replace(newest, at=now, count=newest.count + 1)
        else:
            errors.append(NodeError(at=now, first_at=now, message=error, status=status))

    def error_views(self) -> list[dict[str, object]]:
        """The recent errors as the admin API shows them, newest first."""
        return [error.view() for error in reversed(self.recent_errors)]

    @property
    def status(self) -> NodeStatus:
        """The effective status used for routing: draining once removed, else lifecycle, else liveness."""
        if self.removed:
            return NodeStatus.DRAINING
        return self.lifecycle or self.liveness

    @property
    def eligible(self) -> bool:
        """True when the node may take a new request: healthy, below its concurrency cap, and its breaker
        closed or due a trial."""
        if self.status is not NodeStatus.HEALTHY:
            return False
        breaker = self.breaker
        if breaker.state is not BreakerState.CLOSED and not breaker.trial_due():
            return False
        cap = self.node.capabilities.concurrency
        return cap is None or self.in_flight < cap

    @property
    def last_chance(self) -> bool:
        """True when only the breaker keeps the node out: healthy and below its concurrency cap."""
        cap = self.node.capabilities.concurrency
        return self.status is NodeStatus.HEALTHY and (cap is None or self.in_flight < cap)

    def effective_node(self) -> Node:
        """The registration with the effective status, as the admin API shows it."""
        if self.node.status is self.status:
            return self.node
        return self.node.model_copy(update={"status": self.status})


def select_least_connections(candidates: list[NodeState], rng: random.Random) -> NodeState:
    """Pick the candidate with the fewest requests in flight; ties are broken at random.

    Args:
        candidates: eligible nodes; must not be empty.
        rng: the random source for tie-breaking.

    Returns:
        The chosen node.

    Raises:
        ValueError: `candidates` is empty.
    """
    if not candidates:
        raise ValueError("no candidates to select from")
    loads = [state.in_flight for state in candidates]
    least = min(loads)
    best = [state for state, load in zip(candidates, loads, strict=True) if load == least]
    return best[0] if len(best) == 1 else rng.choice(best)

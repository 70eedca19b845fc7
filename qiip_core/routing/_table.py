"""The routing table: every known node with what this gateway observes about it, and least-connections
selection with reservations.

The registry says which nodes exist (`apply_put`, `apply_delete`); the health checker, the forwarder and
the responses it commits to say how they behave (`set_liveness`, `record_success`, `record_failure`). Requests take a
`Reservation` on the least-loaded healthy node serving their model (or, under prefix affinity, the one
holding their prompt's prefix: `_affinity`) and release it exactly once, however the request ends.
Everything here runs on one event loop and never awaits, so each method is atomic.

Status merging, when the registry (possibly shared with other gateways through etcd) and this gateway
disagree:

- lifecycle statuses from the registry (draining, provisioning, relaunching, …) always win;
- liveness (healthy, unhealthy, unknown) observed by this gateway wins over liveness read from the
  registry; before this gateway has observed a node, the registry's liveness is used;
- a node deleted from the registry turns `draining` and leaves the table when its last request ends.

A model no node serves yet but some will (the daemon's own llama.cpp nodes while they start: `expected`) answers
503 `model_unavailable`, not 404 `model_not_found`: OpenAI clients retry the one, never the other.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from qiip_core._errors import EndpointNotSupported, ModelNotFound, ModelUnavailable, NoNodes, RoutingError
from qiip_core.nodes import LIFECYCLE_STATUSES, ApiName, Engine, Node, NodeStatus
from qiip_core.routing._affinity import PrefixAffinity
from qiip_core.routing._board import ColumnMap, InFlightBoard
from qiip_core.routing._breaker import BreakerPolicy, BreakerState, CircuitBreaker
from qiip_core.routing._reservation import Reservation
from qiip_core.routing._state import NodeState, select_least_connections

__all__ = [
    "ChangeKind",
    "ExpectedModel",
    "NodeState",
    "RoutingTable",
    "TableChange",
    "select_least_connections",
]

logger = logging.getLogger("qiip.routing")


class ChangeKind(StrEnum):
    """What happened to a node in the table."""

    ADDED = "added"
    """A node entered the table."""
    UPDATED = "updated"
    """Its registration or effective status changed."""
    REMOVED = "removed"
    """It left the table."""


@dataclass(frozen=True, slots=True)
class TableChange:
    """A change listeners hear about (`RoutingTable.add_listener`).

    Attributes:
        kind: added, updated or removed.
        node: the node's registration with its effective status at the time of the change.
        reason: why, when the change's cause says (a health probe's outcome, the error that opened a breaker).
    """

    kind: ChangeKind
    node: Node
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ExpectedModel:
    """A model that nodes not registered yet will serve (`RoutingTable.expected`).

    Attributes:
        why: what it waits for, for the error message (`its local node chat-a is starting`).
        retry_after_s: the answer's `Retry-After`, in seconds; None when nothing is on its way (a node that failed
            to start).
        wait_s: how long a request may wait at the gateway for a node of the model to become routable before it
            is answered 503 (a deployment scaled to zero starts a replica on demand); 0: answered at once.
        queue: requests that may wait at once in each serving process; past it, 503 at once.
    """

    why: str
    retry_after_s: float | None
    wait_s: float = 0.0
    queue: int = 0


class RoutingTable:
    """All nodes known to this gateway, with least-connections selection, or prefix affinity over it.

    Args:
        breaker: when nodes' circuit breakers open, and for how long.
        probe_interval_s: the health checker's interval: when a node waiting for a probe may be back, for
            `Retry-After`.
        rng: random source for tie-breaking (tests pass a seeded one).
        affinity: the routing policy per model and the prefix map; None: least-connections for every model.
        board: the board counting requests in flight over every serving process (`server.workers`); None:
            this process's alone.
        columns: the assignment of board columns to nodes, in the process that makes it (the primary); None in
            a worker, which takes them from the primary (`set_column`).
    """

    def __init__(
        self,
        *,
        breaker: BreakerPolicy | None = None,
        probe_interval_s: float = 10.0,
        rng: random.Random | None = None,
        affinity: PrefixAffinity | None = None,
        board: InFlightBoard | None = None,
        columns: ColumnMap | None = None,
    ) -> None:
        self.affinity = affinity
        self.board = board
        self._columns = columns
        self._probe_interval_s = probe_interval_s
        self._states: dict[str, NodeState] = {}
        self._by_model: dict[str, dict[str, NodeState]] = {}
        self._breaker = breaker or BreakerPolicy()
        self._rng = rng or random.Random()
        self._listeners: list[Callable[[TableChange], None]] = []
        self.expected: dict[str, ExpectedModel] = {}
        """Models no registered node serves yet that nodes on their way will (the daemon's own llama.cpp nodes
        while they start, deployments scaled to zero), by name: a request for one gets 503 `model_unavailable`,
        not 404, or waits for a node (`ExpectedModel.wait_s`). Written whole in a worker process (the primary's);
        in the primary through `expect`."""
        self._expected_by_source: dict[str, dict[str, ExpectedModel]] = {}

    def expect(self, source: str, models: Mapping[str, ExpectedModel]) -> None:
        """Set the models `source` expects (`local_nodes`, `deployments`), replacing what it expected before;
        `expected` is then every source's, the first source set winning for a model two expect.

        Args:
            source: who expects them.
            models: `{model: ExpectedModel}` (empty: none any more).
        """
        self._expected_by_source[source] = dict(models)
        merged: dict[str, ExpectedModel] = {}
        for entries in self._expected_by_source.values():
            for model, expected in entries.items():
                merged.setdefault(model, expected)
        self.expected = merged

    # -- reading -------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(list(self._states.values()))

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._states

    def get(self, node_id: str) -> NodeState | None:
        """The node's state, or None."""
        return self._states.get(node_id)

    def serving(self, model: str) -> Collection[NodeState]:
        """The nodes registered for exactly `model`, in any status (empty when none); a live view, not a copy:
        read it, do not keep it across an await."""
        serving = self._by_model.get(model)
        return serving.values() if serving is not None else ()

    def models(self) -> dict[str, Engine]:
        """Models served by at least one healthy node, each with the engine of one of them."""
        served: dict[str, Engine] = {}
        for model, states in self._by_model.items():
            for state in states.values():
                if state.status is NodeStatus.HEALTHY:
                    served[model] = state.node.engine
                    break
        return served

    def count_by_status(self) -> dict[NodeStatus, int]:
        """How many nodes are in each status."""
        counts: dict[NodeStatus, int] = {}
        for state in self._states.values():
            counts[state.status] = counts.get(state.status, 0) + 1
        return counts

    # -- selection -----------------------------------------------------------------------------------------

    def reserve(
        self, model: str, *, api: ApiName | None = None, exclude: Collection[str] = (), prefix: Sequence[int] = ()
    ) -> Reservation:
        """Reserve the least-loaded eligible node serving exactly `model` (and `api`, when given), or the one
        holding the request's longest known prefix (`PrefixAffinity.choose`), which then holds this one's.

        Args:
            model: the requested model, compared as an opaque string.
            api: the OpenAI API asked for; nodes whose capabilities do not list it are never chosen.
            exclude: node ids not to use (already tried by this request).
            prefix: the request's prefix hashes (`PrefixAffinity.prefix_of`); empty: least-connections.

        Returns:
            A reservation on the chosen node; its in-flight count is already incremented.

        Raises:
            NoNodes: the table is empty.
            ModelNotFound: no node, in any status, serves `model`.
            EndpointNotSupported: nodes serve `model`, but none lists `api`.
            ModelUnavailable: nodes serve `model` (and `api`) but none is eligible.
        """
        serving = self._by_model.get(model)
        if not serving:
            raise self.routing_error(model)
        pool: Collection[NodeState] = serving.values()
        if api is not None:
            pool = [s for s in pool if api in s.node.capabilities.endpoints]
            if not pool:
                raise self.routing_error(model, api=api)
        candidates = [s for s in pool if s.eligible and s.id not in exclude]
        if not candidates:
            # Every healthy node of the model has its breaker open: try the least busy, then the one that
            # failed longest ago, rather than refuse without trying (a blip on every node must not become an
            # outage).
            fallback = [s for s in pool if s.id not in exclude]
            last_chance = [s for s in fallback if s.last_chance]
            if not last_chance:
                raise self.routing_error(model)
            state = min(last_chance, key=lambda s: (s.in_flight, s.breaker.last_failure_at or 0.0))
            trial = state.breaker.try_half_open(force=True)
        else:
            affinity = self.affinity if prefix else None
            chosen = affinity.choose(model, candidates, prefix) if affinity is not None else None
            if chosen is not None:
                state = chosen
            else:
                state = candidates[0] if len(candidates) == 1 else select_least_connections(candidates, self._rng)
            if affinity is not None:
                affinity.record(prefix, state.id)
            trial = state.breaker.state is not BreakerState.CLOSED and state.breaker.try_half_open()
        state.add_in_flight(1)
        return Reservation(self, state, trial=trial)

    def routing_error(self, model: str, *, api: ApiName | None = None) -> RoutingError:
        """The error for a request that finds no eligible node: `NoNodes`, `ModelNotFound`,
        `EndpointNotSupported` or `ModelUnavailable` (also for a model only `expected` so far), by the same rules as
        `reserve`."""
        serving = self._by_model.get(model)
        if not serving:
            expected = self.expected.get(model)
            if expected is not None:
                unavailable = ModelUnavailable(
                    f"The model {model!r} is not served yet: {expected.why}; retry later.", model=model
                )
                unavailable.retry_after_s = expected.retry_after_s
                return unavailable
            if not self._states:
                return NoNodes("No inference nodes are registered.", model=model)
            return ModelNotFound(f"The model {_shown_model(model)} does not exist on any node.", model=model)
        if api is not None and not any(api in s.node.capabilities.endpoints for s in serving.values()):
            offered = sorted({e for s in serving.values() for e in s.node.capabilities.endpoints})
            return EndpointNotSupported(
                f"The model {model!r} is not served for {api} by any node (its nodes serve: "
                f"{', '.join(offered) or 'nothing'}).",
                model=model,
            )
        error = ModelUnavailable(
            f"The model {model!r} is registered but no node serving it is available right now "
            f"({_describe_nodes(serving.values())}); retry later.",
            model=model,
        )
        error.retry_after_s = self.retry_after_s(model)
        return error

    def _release(self, state: NodeState) -> None:
        state.add_in_flight(-1)
        if state.removed and state.in_flight <= 0:
            self._drop(state.id)

    def sweep(self) -> None:
        """Drop the nodes deleted from the registry whose last request has ended, in any serving process (on a
        shared board, the last release may be another process's, which this table does not see)."""
        for state in list(self._states.values()):
            if state.removed and state.in_flight <= 0:
                self._drop(state.id)

    def set_column(self, node_id: str, column: int | None) -> None:
        """Count `node_id`'s requests in `column` of the shared board (None: in this process alone); a worker
        takes the columns the primary assigned. Unknown ids, and a table without a board, are ignored."""
        state = self._states.get(node_id)
        if state is not None and self.board is not None:
            state.count_on(self.board, column)

    # -- registry events -----------------------------------------------------------------------------------

    def apply_put(self, node: Node, *, source: str) -> None:
        """Add or update a node from its registry.

        Args:
            node: the registration, endpoint already checked against the allowlist.
            source: where it came from (`config`, `state`, `local`, `etcd`).
        """
        state = self._states.get(node.id)
        if state is None:
            state = NodeState(node, source=source, breaker=self._breaker)
            self._states[node.id] = state
            self._by_model.setdefault(node.model, {})[node.id] = state
            if self._columns is not None:
                column = self._columns.assign(node.id)
                if column is None:
                    logger.warning(
                        "node %s: the in-flight board is full; its requests are counted per process", node.id
                    )
                state.count_on(self.board, column)
            self._notify(ChangeKind.ADDED, state)
            return
        before = (state.node, state.status)
        if node.model != state.node.model:
            self._unindex(state)
            self._by_model.setdefault(node.model, {})[node.id] = state
        if node.endpoint != state.node.endpoint:
            # Another server now: what was observed about the old one says nothing about it.
            state.breaker = CircuitBreaker(self._breaker)
            state.health_failures = 0
            state.observed = False
            state.liveness = NodeStatus.UNKNOWN
        state.node = node
        state.source = source
        state.removed = False
        if node.status in LIFECYCLE_STATUSES:
            state.lifecycle = node.status
        else:
            state.lifecycle = None
            if not state.observed:
                state.liveness = node.status
        if (state.node, state.status) != before:
            self._notify(ChangeKind.UPDATED, state)

    def apply_delete(self, node_id: str) -> None:
        """A node left the registry: stop routing to it, and drop it once its last request ends."""
        state = self._states.get(node_id)
        if state is None:
            return
        if state.in_flight <= 0:
            self._drop(node_id)
            return
        before = state.status
        state.removed = True
        if before is not NodeStatus.DRAINING:
            self._notify(ChangeKind.UPDATED, state)

    def column(self, node_id: str) -> int | None:
        """The board column of `node_id`'s requests in flight, or None (no board, unknown id, or a full board)."""
        state = self._states.get(node_id)
        return state.column if state is not None else None

    def _drop(self, node_id: str) -> None:
        state = self._states.pop(node_id, None)
        if state is not None:
            state.count_on(None, None)
            if self._columns is not None:
                self._columns.release(node_id)
            self._unindex(state)
            self._notify(ChangeKind.REMOVED, state)

    def _unindex(self, state: NodeState) -> None:
        serving = self._by_model.get(state.node.model)
        if serving is not None:
            serving.pop(state.id, None)
            if not serving:
                del self._by_model[state.node.model]

    # -- observations --------------------------------------------------------------------------------------

    def set_liveness(self, node_id: str, liveness: NodeStatus, *, reason: str | None = None) -> None:
        """Record this gateway's own observation: healthy, unhealthy or unknown. Unknown ids are ignored.

        Raises:
            ValueError: `liveness` is a lifecycle status.
        """
        if liveness in LIFECYCLE_STATUSES:
            raise ValueError(f"{liveness.value} is a lifecycle status, not an observation")
        state = self._states.get(node_id)
        if state is None:
            return
        state.observed = True
        if state.liveness is liveness:
            return
        before = state.status
        state.liveness = liveness
        if state.status is not before:
            logger.info(
                "node %s: %s -> %s%s",
                node_id,
                before.value,
                state.status.value,
                f" ({reason})" if reason else "",
            )
        self._notify(ChangeKind.UPDATED, state, reason)

    def set_lifecycle(self, node_id: str, lifecycle: NodeStatus | None) -> None:
        """Set or clear (None) a lifecycle status decided on this gateway, such as a drain.

        Raises:
            ValueError: `lifecycle` is a liveness status.
        """
        if lifecycle is not None and lifecycle not in LIFECYCLE_STATUSES:
            raise ValueError(f"{lifecycle.value} is an observation, not a lifecycle status")
        state = self._states.get(node_id)
        if state is None or state.lifecycle is lifecycle:
            return
        state.lifecycle = lifecycle
        self._notify(ChangeKind.UPDATED, state)

    def record_success(self, node_id: str) -> None:
        """A request to the node succeeded: its breaker closes (`CircuitBreaker.record_success`)."""
        state = self._states.get(node_id)
        if state is None:
            return
        was_closed = state.breaker.state is BreakerState.CLOSED
        state.breaker.record_success()
        if not was_closed:
            logger.info("node %s: breaker closed (a request succeeded)", node_id)
            self._notify(ChangeKind.UPDATED, state, "a request succeeded")

    def record_failure(self, node_id: str, error: str, *, started_at: float | None = None, noted: bool = False) -> bool:
        """A request to the node failed with a connect error, timeout, broken answer or 5xx
        (`CircuitBreaker.record_failure`). The node's liveness is the health checker's: an open breaker only
        keeps ordinary traffic away until its trial.

        Args:
            node_id: the node.
            error: what went wrong, for operators.
            started_at: when the request was sent (`time.monotonic()` seconds), so concurrent failures are
                one signal; None counts it.
            noted: the failure is in the node's error record already (`NodeState.note_error`).

        Returns:
            True when the breaker is open after this failure.
        """
        state = self._states.get(node_id)
        if state is None:
            return False
        if not noted:
            state.note_error(error)
        was_closed = state.breaker.state is BreakerState.CLOSED
        opened = state.breaker.record_failure(started_at)
        if opened and was_closed:
            logger.info("node %s: breaker open (%s)", node_id, error)
            self._notify(ChangeKind.UPDATED, state, error)
        return opened

    def retry_after_s(self, model: str) -> float | None:
        """Seconds until a node of `model` can next be tried, the earliest over its nodes: a node with an open
        breaker at its breaker's next trial, or at its next health probe if that comes first (a good probe runs the
        trial at once); a node waiting for a health probe (unhealthy or unknown) at that probe. None when no node
        will be tried by itself (draining, provisioning, or busy).

        Args:
            model: the model.
        """
        serving = self._by_model.get(model)
        if not serving:
            return None
        now = time.monotonic()
        waits = [
            min(max(0.0, s.breaker.retry_at - now), self._probe_interval_s)
            for s in serving.values()
            if s.breaker.state is BreakerState.OPEN
        ]
        if any(s.status in (NodeStatus.UNHEALTHY, NodeStatus.UNKNOWN) for s in serving.values()):
            waits.append(self._probe_interval_s)
        return min(waits) if waits else None

    def mark_heartbeat(self, node_id: str) -> None:
        """Record a successful health observation time on the node's registration."""
        state = self._states.get(node_id)
        if state is not None:
            state.node = state.node.model_copy(update={"last_heartbeat": datetime.now(UTC)})

    # -- listeners -----------------------------------------------------------------------------------------

    def routable(self, model: str) -> bool:
        """Whether a node serving `model` is healthy now (a request for it would be given a node)."""
        serving = self._by_model.get(model)
        return serving is not None and any(s.status is NodeStatus.HEALTHY for s in serving.values())

    async def wait_routable(self, model: str, timeout_s: float) -> bool:
        """Wait until a node serving `model` is healthy (`routable`), for at most `timeout_s` seconds; woken by
        the table's own changes, never by polling.

        Returns:
            Whether one is.
        """
        if self.routable(model):
            return True
        changed = asyncio.Event()

        def heard(change: TableChange) -> None:
            if change.node.model == model:
                changed.set()

        remove = self.add_listener(heard)
        try:
            async with asyncio.timeout(timeout_s):
                while not self.routable(model):
                    changed.clear()
                    await changed.wait()
        except TimeoutError:
            return False
        finally:
            remove()
        return True

    def add_listener(self, listener: Callable[[TableChange], None]) -> Callable[[], None]:
        """Call `listener` on every added, updated or removed node.

        Returns:
            A function that removes the listener.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _notify(self, kind: ChangeKind, state: NodeState, reason: str | None = None) -> None:
        if not self._listeners:
            return
        change = TableChange(kind, state.effective_node(), reason)
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:
                logger.exception("a routing-table listener failed")


def _describe_nodes(states: Collection[NodeState]) -> str:
    """How many nodes serve a model and in what state, for an error message: `3 nodes: 2 unhealthy, 1 with
    its circuit breaker open`."""
    counts: dict[str, int] = {}
    for state in states:
        if state.status is NodeStatus.HEALTHY and state.breaker.is_open:
            what = "with its circuit breaker open"
        elif state.status is NodeStatus.HEALTHY:
            what = "busy (at its concurrency limit) or already tried"
        else:
            what = state.status.value
        counts[what] = counts.get(what, 0) + 1
    noun = "node" if len(states) == 1 else "nodes"
    return f"{len(states)} {noun}: " + ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))


def _shown_model(model: str, limit: int = 200) -> str:
    """`model` quoted for an error message, cut to `limit` characters: a client's model name is echoed
    back, and one of a megabyte must not come back whole."""
    if len(model) <= limit:
        return repr(model)
    return f"{model[:limit]!r}… ({len(model)} characters)"

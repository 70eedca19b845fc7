"""Node lifecycle operations: drain, undrain, remove, relaunch; run in the background as tracked operations.

Every operation that waits (a drain, a removal, a relaunch) runs as an `Operation`: it has an id the
admin API answers with (202), a state, a bounded log of what it did, and a result. The rules of who may
do what live here (`check_*`, each raising `NodeConflict` with the reason: 409), so the daemon and the
console agree:

| operation | allowed when the node is |
|---|---|
| drain | healthy, unhealthy or unknown (not already draining, relaunching, provisioning) |
| undrain | draining by an operator's drain |
| remove | anything but relaunching or provisioning (`force` removes at once, without draining) |
| relaunch | healthy, managed, llama.cpp, with a runtime record, launched by this daemon |

A relaunch is checked before it starts (`ManagedLlamaServer.preflight`: the model file and a plan against the memory
the node will have once its server stops), then drains; a drain that times out restores the node untouched. It may
move the node to another GGUF generation (an `artifact_id`), under the same alias and endpoint. If the new sizing cannot
start, the previous model and sizing are restored (automatic sizing recomputed, custom replayed); if that fails too the
node is `relaunch_failed`, and only removal is left.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from qiip_core._errors import NodeConflict, NodeNotFound, QiipError, RelaunchError
from qiip_core.engines.llamacpp import ManagedLlamaServer
from qiip_core.nodes import Engine, Node, NodeStatus
from qiip_core.planner import AutoPolicy, CustomPolicy
from qiip_core.routing import RoutingTable

__all__ = [
    "Fleet",
    "Operation",
    "OperationLog",
    "OperationRunner",
    "OperationState",
    "check_can_drain",
    "check_can_relaunch",
    "check_can_remove",
    "check_can_undrain",
    "drain",
    "relaunch",
    "remove",
]

logger = logging.getLogger("qiip.lifecycle")


class Fleet(Protocol):
    """Where lifecycle changes are recorded: a `Registry`, or the daemon's view that also covers nodes kept
    outside the registry (attached endpoints)."""

    async def set_lifecycle(self, node_id: str, status: NodeStatus | None) -> None:
        """Put the node into a lifecycle status, or take it out (None)."""

    async def register(self, node: Node, *, ephemeral: bool = False) -> Node:
        """Add or replace a registration."""

    async def deregister(self, node_id: str) -> None:
        """Remove a registration."""


_BUSY = frozenset({NodeStatus.RELAUNCHING, NodeStatus.PROVISIONING})


class OperationState(StrEnum):
    """Where an operation is."""

    RUNNING = "running"
    """Started, not finished."""
    SUCCEEDED = "succeeded"
    """Finished as asked."""
    FAILED = "failed"
    """Finished without doing what was asked; `error` says why."""
    CANCELLED = "cancelled"
    """Stopped by an operator (`OperationRunner.cancel`) before it finished."""


@dataclass(slots=True)
class OperationLog:
    """A bounded log of one operation: `(time, level, message)` entries, oldest dropped first."""

    entries: collections.deque[tuple[datetime, str, str]] = field(default_factory=lambda: collections.deque(maxlen=500))

    def __call__(self, message: str, level: str = "info") -> None:
        """Add an entry (and log it)."""
        self.entries.append((datetime.now(UTC), level, message))
        logger.log(logging.WARNING if level == "warning" else logging.INFO, "%s", message)


@dataclass(slots=True)
class Operation:
    """One background operation on one node.

    Attributes:
        id: `op_` + 16 hex.
        kind: `drain`, `remove` or `relaunch`.
        node_id: the node.
        state: running, succeeded or failed.
        started_at, finished_at: UTC times.
        result: what the operation found (for a drain: what remained in flight).
        error: why it failed.
        log: what it did, step by step.
    """

    id: str
    kind: str
    node_id: str
    state: OperationState = OperationState.RUNNING
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    finished_at: datetime | None = None
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    log: OperationLog = field(default_factory=OperationLog)

    def view(self) -> dict[str, Any]:
        """The operation as JSON for the admin API."""
        return {
            "id": self.id,
            "kind": self.kind,
            "node_id": self.node_id,
            "state": self.state.value,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "result": self.result,
            "error": self.error,
            "log": [{"at": at.isoformat(), "level": level, "message": msg} for at, level, msg in self.log.entries],
        }


class OperationRunner:
    """Runs operations in the background and keeps the last `history` of them.

    Args:
        history: finished operations kept for lookup.
    """

    def __init__(self, history: int = 200) -> None:
        self._operations: collections.OrderedDict[str, Operation] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._history = history
        self._running_by_node: dict[str, str] = {}
        self._task_by_id: dict[str, asyncio.Task[None]] = {}
        self._begun: set[str] = set()
        self._listeners: list[Callable[[Operation], None]] = []

    def add_listener(self, listener: Callable[[Operation], None]) -> None:
        """Call `listener(operation)` when an operation starts and again when it finishes (its `state` says which).

        A listener runs on the event loop and must not raise; one that does is logged and skipped.
        """
        self._listeners.append(listener)

    def _tell(self, operation: Operation) -> None:
        for listener in list(self._listeners):
            try:
                listener(operation)
            except Exception:
                logger.exception("an operation listener failed")

    @staticmethod
    def new_id() -> str:
        """A fresh operation id: `op_` + 16 hex."""
        return "op_" + os.urandom(8).hex()

    def start(
        self,
        kind: str,
        node_id: str,
        work: Callable[[Operation], Awaitable[dict[str, Any]]],
        *,
        operation_id: str | None = None,
    ) -> Operation:
        """Start `work(operation)` in the background; its returned dict becomes the result.

        Args:
            kind: what the operation does (`drain`, `setup`, …).
            node_id: the node (or host) it works on; one operation per node at a time.
            work: the operation's body.
            operation_id: the id to use (`new_id()`), when the caller needed it before the start.

        Raises:
            NodeConflict: another operation on this node is still running.
        """
        running = self._running_by_node.get(node_id)
        if running is not None:
            raise NodeConflict(f"Node {node_id!r} is busy with operation {running}; wait for it to finish.")
        operation = Operation(id=operation_id or self.new_id(), kind=kind, node_id=node_id)
        self._operations[operation.id] = operation
        self._running_by_node[node_id] = operation.id
        while len(self._operations) > self._history:
            oldest = next(iter(self._operations.values()))
            if oldest.state is OperationState.RUNNING:
                break
            self._operations.popitem(last=False)
        task = asyncio.create_task(self._run(operation, work), name=f"qiip-{kind}-{node_id}")
        self._tasks.add(task)
        self._task_by_id[operation.id] = task
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._task_by_id.pop(operation.id, None))
        self._tell(operation)
        return operation

    def cancel(self, operation_id: str) -> bool:
        """Cancel a running operation (its work sees `CancelledError` and cleans up). Returns False when it is not
        running."""
        task = self._task_by_id.get(operation_id)
        if task is None or task.done():
            return False
        if operation_id not in self._begun:
            # A task cancelled before its first step never enters its body, whose cleanup (a lease, a remote
            # command) would then never run: deliver the cancellation once the body has begun.
            asyncio.get_running_loop().call_soon(self.cancel, operation_id)
            return True
        task.cancel()
        return True

    async def _run(self, operation: Operation, work: Callable[[Operation], Awaitable[dict[str, Any]]]) -> None:
        self._begun.add(operation.id)
        try:
            operation.result = await work(operation)
            operation.state = OperationState.SUCCEEDED
        except QiipError as exc:
            operation.state, operation.error = OperationState.FAILED, exc.message
            operation.log(exc.message, "warning")
        except asyncio.CancelledError:
            operation.state, operation.error = OperationState.CANCELLED, "cancelled before it finished"
            operation.log("cancelled", "warning")
        except Exception as exc:
            operation.state, operation.error = OperationState.FAILED, f"internal error: {exc!r}"
            logger.exception("operation %s on %s failed", operation.kind, operation.node_id)
        finally:
            operation.finished_at = datetime.now(UTC)
            self._running_by_node.pop(operation.node_id, None)
            self._begun.discard(operation.id)
            self._tell(operation)

    def get(self, operation_id: str) -> Operation | None:
        """An operation by id."""
        return self._operations.get(operation_id)

    def list(self) -> list[Operation]:
        """Every kept operation, newest first."""
        return list(reversed(self._operations.values()))

    async def aclose(self) -> None:
        """Cancel running operations."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# -- rules ---------------------------------------------------------------------------------------------------


def _state(table: RoutingTable, node_id: str) -> Node:
    state = table.get(node_id)
    if state is None:
        raise NodeNotFound(node_id)
    return state.effective_node()


def check_can_drain(table: RoutingTable, node_id: str) -> None:
    """Raises NodeNotFound, or NodeConflict when the node's status forbids a drain."""
    node = _state(table, node_id)
    if node.status not in (NodeStatus.HEALTHY, NodeStatus.UNHEALTHY, NodeStatus.UNKNOWN):
        raise NodeConflict(f"Node {node_id!r} is {node.status.value}; only a serving node can be drained.")


def check_can_undrain(table: RoutingTable, node_id: str) -> None:
    """Raises NodeNotFound, or NodeConflict when the node is not draining."""
    node = _state(table, node_id)
    if node.status is not NodeStatus.DRAINING:
        raise NodeConflict(f"Node {node_id!r} is {node.status.value}, not draining.")


def check_can_remove(table: RoutingTable, node_id: str) -> None:
    """Raises NodeNotFound, or NodeConflict while the node is relaunching or provisioning."""
    node = _state(table, node_id)
    if node.status in _BUSY:
        raise NodeConflict(f"Node {node_id!r} is {node.status.value}; wait for that to finish before removing it.")


def check_can_relaunch(table: RoutingTable, node_id: str, server: ManagedLlamaServer | None) -> None:
    """Raises NodeNotFound, or NodeConflict unless the node is a managed llama.cpp node with a runtime record that
    this daemon launched, and healthy or unhealthy: relaunching is how an operator brings back a llama-server
    that crashed or hangs (its drain is immediate); a node draining, relaunching or failed is refused."""
    node = _state(table, node_id)
    reasons = []
    if node.status not in (NodeStatus.HEALTHY, NodeStatus.UNHEALTHY):
        reasons.append(f"it is {node.status.value}, not healthy or unhealthy")
    if not node.managed or server is None:
        reasons.append("it is not a node this daemon launched")
    if node.engine is not Engine.LLAMA_CPP:
        reasons.append(f"its engine is {node.engine.value}, not llama_cpp")
    if node.llamacpp_runtime is None:
        reasons.append("it has no verified runtime record")
    if reasons:
        raise NodeConflict(f"Node {node_id!r} cannot be relaunched: {'; '.join(reasons)}.")


# -- operations ----------------------------------------------------------------------------------------------


async def _wait_idle(table: RoutingTable, node_id: str, timeout_s: float) -> int:
    """Wait until the node has nothing in flight (or is gone), up to `timeout_s`. Returns what remains."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for delay in itertools.chain([0.01, 0.02, 0.05], itertools.repeat(0.1)):
        state = table.get(node_id)
        if state is None or state.in_flight <= 0:
            return 0
        if loop.time() >= deadline:
            return state.in_flight
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
    raise AssertionError("unreachable")


async def drain(
    table: RoutingTable, registry: Fleet, node_id: str, *, timeout_s: float, log: OperationLog
) -> dict[str, Any]:
    """Stop sending the node new requests and wait for those in flight, up to `timeout_s`.

    Returns:
        `{"remaining_in_flight": n, "timed_out": bool}`; the node stays draining either way (undrain it, or
        remove it).
    """
    await registry.set_lifecycle(node_id, NodeStatus.DRAINING)
    log(f"node {node_id} is draining: no new requests")
    remaining = await _wait_idle(table, node_id, timeout_s)
    if remaining:
        log(f"{remaining} request(s) still in flight after {timeout_s:g} s", "warning")
    else:
        log(f"node {node_id} has nothing in flight")
    return {"remaining_in_flight": remaining, "timed_out": bool(remaining)}


async def remove(
    table: RoutingTable,
    registry: Fleet,
    node_id: str,
    *,
    force: bool,
    timeout_s: float,
    log: OperationLog,
    server: ManagedLlamaServer | None = None,
) -> dict[str, Any]:
    """Drain the node (unless `force`), stop its llama-server when this daemon launched it, deregister it.

    Returns:
        `{"remaining_in_flight": n}`: requests still in flight when it was removed (they finish or fail on
        their own; the node leaves the routing table once they end).
    """
    remaining = 0
    if not force:
        remaining = (await drain(table, registry, node_id, timeout_s=timeout_s, log=log))["remaining_in_flight"]
    if server is not None:
        await server.stop()
        log(f"stopped the llama-server of {node_id}")
    await registry.deregister(node_id)
    log(f"node {node_id} deregistered")
    return {"remaining_in_flight": remaining, "forced": force}


async def relaunch(
    table: RoutingTable,
    registry: Fleet,
    server: ManagedLlamaServer,
    node: Node,
    policy: AutoPolicy | CustomPolicy,
    *,
    drain_timeout_s: float,
    startup_timeout_s: float,
    log: OperationLog,
    artifact: tuple[str, Path] | None = None,
) -> dict[str, Any]:
    """Drain, stop, plan, launch, verify and restore a managed llama.cpp node with a new sizing policy, and on
    another GGUF generation when `artifact` is given.

    Args:
        table: the routing table (in-flight counts).
        registry: where the node's record is replaced.
        server: the node's llama-server.
        node: the node's record as it was.
        policy: the new sizing.
        drain_timeout_s: how long the drain may wait for requests in flight, in seconds.
        startup_timeout_s: how long the llama-server may take to become healthy, in seconds.
        log: the operation's log.
        artifact: `(artifact_id, entrypoint)` of the generation to serve instead; the record then carries that
            `artifact_id`. Resolve it, and check the whole relaunch (`ManagedLlamaServer.preflight`: the file and
            the fit) before calling: this drains first.

    Returns:
        `{"llamacpp_runtime": record, "artifact_id": id}`.

    Raises:
        NodeConflict: the drain timed out (the node is restored untouched).
        RelaunchError: the new policy failed; the node runs its previous sizing again (`rolled_back`), or is
            `relaunch_failed` (only removal is left).
    """
    node_id = node.id
    await registry.set_lifecycle(node_id, NodeStatus.RELAUNCHING)
    log(f"node {node_id} is relaunching with sizing {policy.sizing}: draining")
    remaining = await _wait_idle(table, node_id, drain_timeout_s)
    if remaining:
        await registry.set_lifecycle(node_id, None)
        raise NodeConflict(
            f"The drain timed out after {drain_timeout_s:g} s with {remaining} request(s) in flight; "
            f"node {node_id} was restored untouched."
        )
    log("drained; stopping llama-server and planning the new sizing")
    update: dict[str, Any] = {}
    if artifact is not None:
        update["artifact_id"] = artifact[0]
        log(f"serving artifact {artifact[0]} ({artifact[1]}) next")
    try:
        runtime = await server.relaunch(
            policy, startup_timeout_s=startup_timeout_s, model_path=artifact[1] if artifact else None
        )
    except RelaunchError as exc:
        if exc.rolled_back:
            await registry.register(node.model_copy(update={"llamacpp_runtime": server.runtime}), ephemeral=True)
            log("the previous sizing runs again; node restored", "warning")
        else:
            await registry.register(node.model_copy(update={"llamacpp_runtime": None}), ephemeral=True)
            await registry.set_lifecycle(node_id, NodeStatus.RELAUNCH_FAILED)
            log("the rollback failed too: the node is relaunch_failed; only removal is left", "warning")
        raise
    relaunched = node.model_copy(update={"llamacpp_runtime": runtime, **update})
    await registry.register(relaunched, ephemeral=True)
    log(
        f"relaunched and verified: {runtime.effective.get('slots')} slot(s) x "
        f"{runtime.effective.get('context_per_slot')} tokens, K/V {runtime.effective.get('cache_type_k')}"
    )
    return {"llamacpp_runtime": runtime.model_dump(mode="json"), "artifact_id": relaunched.artifact_id}

"""Schedule enforcement: managed nodes on hosts QUADS takes back within the lookahead, or marks broken or retired,
are drained and torn down (through the provisioner's teardown, which forgets the host's key: QUADS re-images it)
before the reservation starts; a failed teardown is retried with capped exponential backoff. The decisions are
`_policy`'s; this is the loop around them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import datetime

from qiip_core._errors import QiipError
from qiip_core.config import QuadsSettings
from qiip_core.lifecycle import Operation, OperationState, check_can_remove
from qiip_core.provisioning import Provisioner
from qiip_core.quads._models import normalise_host
from qiip_core.quads._policy import Backoff, Teardown, plan_teardowns
from qiip_core.quads._poller import Clock, QuadsPoller, utc_now
from qiip_core.routing import RoutingTable

__all__ = ["QuadsEnforcer"]

logger = logging.getLogger("qiip.quads")


class QuadsEnforcer:
    """Tears down managed nodes whose hosts QUADS takes back.

    Args:
        poller: where the schedule comes from (its last good read).
        provisioner: runs the teardowns and keeps the hosts' logs.
        table: the routing table (which nodes are managed).
        settings: `[quads]` (lookahead, interval, backoff).
        clock: the time now.
    """

    def __init__(
        self,
        poller: QuadsPoller,
        provisioner: Provisioner,
        table: RoutingTable,
        settings: QuadsSettings,
        *,
        clock: Clock = utc_now,
    ) -> None:
        self.poller = poller
        self.provisioner = provisioner
        self.table = table
        self.settings = settings
        self.clock = clock
        self.backoffs: dict[str, Backoff] = {}
        """Hosts whose teardown failed, with when to try again."""
        self.running: dict[str, Operation] = {}
        """Teardowns this enforcer started that may still run, by host."""

    async def managed_hosts(self) -> dict[str, str]:
        """Managed nodes set up over SSH: normalised host name → node id."""
        found: dict[str, str] = {}
        for state in list(self.table):
            if not state.effective_node().managed:
                continue
            if await self.provisioner.is_provisioned(state.id):
                found[normalise_host(state.id)] = state.id
        return found

    def _replica(self, node_id: str) -> bool:
        state = self.table.get(node_id)
        return state is not None and state.effective_node().deployment is not None

    def _collect(self, now: datetime) -> None:
        """Count the teardowns that ended since the last tick: a failure backs off, a success forgets the host."""
        for host, operation in list(self.running.items()):
            if operation.state is OperationState.RUNNING:
                continue
            del self.running[host]
            if operation.state is OperationState.SUCCEEDED:
                self.backoffs.pop(host, None)
                logger.info("QUADS enforcement: %s torn down", host)
            else:
                self._failed(host, now, operation.error or operation.state.value)

    def _failed(self, host: str, now: datetime, error: str) -> None:
        backoff = self.backoffs.setdefault(host, Backoff())
        delay = backoff.failed(now, error, initial_s=self.settings.backoff_initial_s, cap_s=self.settings.backoff_cap_s)
        message = f"QUADS enforcement: the teardown of {host} failed ({error}); next attempt in {delay:g} s"
        logger.warning("%s", message)
        self.provisioner.logs.append(host, message, level="error", step="quads")

    async def tick(self) -> list[Teardown]:
        """One round: collect ended teardowns, then start those the schedule asks for. Returns the teardowns
        started."""
        now = self.clock()
        self._collect(now)
        snapshot = self.poller.snapshot
        if snapshot is None:
            return []
        managed = await self.managed_hosts()
        # A deployment's replica is moved make-before-break by its controller from the lookahead on; the enforcement
        # tears it down only `replica_teardown_before_s` before the reservation, if it is still there.
        replicas = {h for h, node_id in managed.items() if self._replica(node_id)}
        plans = sorted(
            plan_teardowns(
                [h for h in managed if h not in replicas],
                snapshot,
                now,
                lookahead_s=self.settings.lookahead_s,
                backoffs=self.backoffs,
                busy=self.running,
            )
            + plan_teardowns(
                replicas,
                snapshot,
                now,
                lookahead_s=min(self.settings.lookahead_s, self.settings.replica_teardown_before_s),
                backoffs=self.backoffs,
                busy=self.running,
            ),
            key=lambda t: (t.conflict_at, t.host),
        )
        started: list[Teardown] = []
        for plan in plans:
            node_id = managed[plan.host]
            logger.warning("QUADS enforcement: %s", plan.reason)
            try:
                check_can_remove(self.table, node_id)  # not while it is being set up: retried after a backoff
                # QUADS re-images a host before lending it again: its host key goes with the node.
                operation = await self.provisioner.start_teardown(
                    node_id, force=False, reason=plan.reason, forget_host_key=True
                )
            except QiipError as exc:
                self.provisioner.logs.append(plan.host, plan.reason, level="warning", step="quads")
                self._failed(plan.host, now, exc.message)
                continue
            self.running[plan.host] = operation
            started.append(plan)
        return started

    async def run(self) -> None:
        """Enforce every `enforce_interval_s` until cancelled (the first round after the first poll)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.enforce_interval_s):
                await self.poller.polled.wait()
        while True:
            try:
                await self.tick()
            except QiipError as exc:
                logger.error("QUADS enforcement round failed: %s", exc.message)
            except Exception:  # a bug must not end the enforcement
                logger.exception("QUADS enforcement round failed unexpectedly")
            await asyncio.sleep(self.settings.enforce_interval_s)

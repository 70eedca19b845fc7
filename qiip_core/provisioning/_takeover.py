"""Takeover: what an operation whose gateway died left behind, adopted by a live one.

Operations survive their owner: `Takeover.reconcile` (every `provisioning.reconcile_interval_s`, and at start-up)
adopts each running task no live gateway holds: its task is marked failed at the step it reached, its node failed,
the run it left on the host ended, and the host freed. Any gateway sharing etcd does so within `host_lease_ttl_s`
plus one interval of the owner's death; a restarted gateway does so for its own at once. A new operation that
takes a host whose record is still running supersedes it the same way (`Takeover.supersede`), in line.

The pass is level-triggered: it reads the task records and the hosts' leases each time and keeps no memory of its
own, so a restart loses nothing. The provisioner holds one `Takeover` and answers `recover` and `reconcile` with it.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable, Container, Coroutine
from typing import Any

from qiip_core._errors import HostBusy, QiipError
from qiip_core.config import ProvisioningSettings
from qiip_core.lifecycle import Fleet, OperationRunner
from qiip_core.nodes import Engine, NodeStatus
from qiip_core.provisioning._bundle import LOCK_WAIT_S, end_previous_runs, engine_script_name
from qiip_core.provisioning._logs import HostLogs
from qiip_core.provisioning._pipeline import engine_started
from qiip_core.provisioning._ssh import SshTarget, open_ssh
from qiip_core.provisioning._tasks import HostLease, ProvisioningTask, TaskState, TaskStore, utc_now
from qiip_core.routing import RoutingTable

__all__ = ["Takeover"]

logger = logging.getLogger("qiip.provisioning")


FREED = "the host is free again"
"""The start of the host's log line a takeover ends with, once the host's lease is given back."""


class Takeover:
    """Adopts the operations no live gateway holds, and marks the nodes they leave failed.

    Args:
        provisioning: the daemon's `[provisioning]` settings.
        store: task records and host leases.
        logs: the hosts' logs.
        table: the routing table (a node's status is read from it).
        fleet: where nodes are registered (and marked failed).
        running: the hosts this gateway's own operations run on now (read at each pass).
        target: how to reach a host over SSH (read at each use, with the known-hosts file of that moment).
    """

    def __init__(
        self,
        provisioning: ProvisioningSettings,
        store: TaskStore,
        logs: HostLogs,
        table: RoutingTable,
        fleet: Fleet,
        *,
        running: Container[str],
        target: Callable[[str], SshTarget],
    ) -> None:
        self.p = provisioning
        self.store = store
        self.logs = logs
        self.table = table
        self.fleet = fleet
        self._running = running
        self._target = target
        self._reconciler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    async def supersede(self, host: str, lease: HostLease) -> bool:
        """Take over a record an operation left running (its owner died; this one holds the lease now): say so in
        the host's log, and mark a setup's node failed. Returns True when a node was marked failed.

        The remote run it left is ended by this operation's first remote step (`end_previous_runs`).
        """
        task = await self.store.get(host)
        if task is None or task.state is not TaskState.RUNNING or task.generation == lease.generation:
            return False
        self.logs.append(
            host,
            f"the earlier {task.kind} {task.operation_id} of {task.owner} stopped during step {task.current_step} "
            "without finishing; this operation takes the host over and ends what it left running",
            level="warning",
            step=task.current_step,
        )
        return task.kind == "setup" and await self.fail_node(host)

    async def fail_node(self, host: str) -> bool:
        """Mark the node of `host` failed, when it is registered and not failed yet; True when it is failed now."""
        state = self.table.get(host)
        if state is None:
            return False
        if state.effective_node().status is not NodeStatus.FAILED:
            try:
                await self.fleet.set_lifecycle(host, NodeStatus.FAILED)
            except QiipError as exc:
                logger.warning("could not mark node %s failed: %s", host, exc.message)
                return False
        return True

    async def recover(self) -> list[ProvisioningTask]:
        """Adopt what a gateway that died left running (at start-up, this gateway's own from before a restart),
        restore the failed nodes' status, then keep doing so every `provisioning.reconcile_interval_s`.

        Returns:
            The tasks adopted now.

        Raises:
            QiipError: the task records cannot be read (the loop still starts and tries again).
        """
        if self._reconciler is None:
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_loop(), name="qiip-takeover")
        return await self.reconcile()

    async def _reconcile_loop(self) -> None:
        failing: str | None = None  # logged once per outage, not once per pass
        while True:
            await asyncio.sleep(self.p.reconcile_interval_s)
            try:
                await self.reconcile()
            except QiipError as exc:
                if exc.message != failing:
                    logger.warning("provisioning reconcile failed, retrying every %g s: %s",
                                   self.p.reconcile_interval_s, exc.message)  # fmt: skip
                failing = exc.message
                continue
            except Exception:  # a bug must not end the takeovers
                logger.exception("provisioning reconcile failed unexpectedly")
                continue
            if failing is not None:
                logger.info("provisioning reconcile works again")
                failing = None

    async def reconcile(self) -> list[ProvisioningTask]:
        """One level-triggered pass: adopt every running task no live operation holds (its owner's lease expired,
        or this gateway restarted): take the host's lease with a new generation, mark the task failed at the step
        it reached and its node failed, then, in the background, end the run it left on the host (and a setup's
        engine) and free the host. Then give every node a failed setup left registered its `failed` status (a
        status the embedded registry keeps in memory only).

        Returns:
            The tasks adopted in this pass.

        Raises:
            QiipError: the task records cannot be read.
        """
        adopted = []
        for task, why in await self.store.stale():
            try:
                lease = await self.store.acquire(task.hostname, OperationRunner.new_id())
            except HostBusy:
                continue  # another gateway adopts it, or a new operation took the host
            try:
                failed = await self._adopt(task, why, lease)
            except BaseException:
                await asyncio.shield(lease.release())
                raise
            if failed is None:
                await lease.release()
                continue
            adopted.append(failed)
            self._spawn(self._end_remote(failed, lease), f"qiip-end-run-{task.hostname}")
        await self._restore_failed_nodes()
        return adopted

    async def _adopt(self, stale: ProvisioningTask, why: str, lease: HostLease) -> ProvisioningTask | None:
        current = await self.store.get(stale.hostname)
        if current is None or current.state is not TaskState.RUNNING:
            return None
        host, step = current.hostname, current.current_step
        message = (
            f"The gateway {current.owner} stopped during step {step} ({why}); {self.store.owner} took the host over "
            f"and ends what it left running. Run the {current.kind} again."
        )
        failed = current.model_copy(
            update={
                "state": TaskState.FAILED,
                "failed_step": step,
                "error": message,
                "updated_at": utc_now(),
                "generation": lease.generation,
                "interrupted": True,
            }
        )
        await self.store.put(failed)
        logger.warning("provisioning of %s was interrupted: %s", host, message)
        self.logs.append(host, message, level="error", step=step)
        if current.kind == "setup":
            await self.fail_node(host)
        return failed

    async def _end_remote(self, task: ProvisioningTask, lease: HostLease) -> None:
        """End the run an adopted task left on its host (and the engine of a setup that had started it), then free
        the host; an unreachable host is left to the next operation's first step."""
        host = task.hostname
        tag = f"{lease.operation_id} gen {lease.generation}"
        try:
            async with asyncio.timeout(self.p.connect_timeout_s + LOCK_WAIT_S + 90.0):
                target = self._target(host)
                async with open_ssh(target, run_tag=tag) as ssh:
                    for ended in await end_previous_runs(ssh, lock_wait_s=LOCK_WAIT_S):
                        self.logs.append(host, f"ended the run left on the host: {ended}", level="warning")
                    if task.kind == "setup" and task.engine and engine_started(task.current_step):
                        name = engine_script_name(Engine(task.engine))
                        command = (
                            f'f="${{QIIPNODE_ROOT:-}}"{shlex.quote(self.p.remote_dir + "/stop-engine.sh")}; '
                            f'if [ -f "$f" ]; then bash "$f" {name} --force; fi'
                        )
                        await ssh.run(command, total_timeout_s=60.0, idle_timeout_s=60.0, what="stop-engine.sh")
                        self.logs.append(host, f"stopped the {name} engine the interrupted setup had started")
        except (QiipError, OSError, TimeoutError) as exc:
            reason = exc.message if isinstance(exc, QiipError) else (str(exc) or type(exc).__name__)
            logger.warning("could not end the run left on %s (the next operation there ends it first): %s", host,
                           reason)  # fmt: skip
            self.logs.append(host, f"could not end the run left on the host yet: {reason}", level="warning")
        finally:
            await asyncio.shield(lease.release())
            self.logs.append(host, f"{FREED} by {self.store.owner} after taking it over")

    async def _restore_failed_nodes(self) -> None:
        for task in await self.store.list_tasks():
            if task.kind == "setup" and task.state in (TaskState.FAILED, TaskState.CANCELLED):
                if task.hostname not in self._running:
                    await self.fail_node(task.hostname)

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        job = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(job)
        job.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        """End the reconcile loop and the takeovers still ending a run on their host."""
        jobs = [*self._background, *([self._reconciler] if self._reconciler is not None else [])]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self._reconciler = None

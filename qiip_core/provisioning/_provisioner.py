"""The provisioner: what the daemon's admin API calls to set hosts up, tear them down and follow them.

It owns the rules of who may start what, so the API and the console agree:

| refusal | when |
|---|---|
| 400 `host_not_allowed` | the host name is malformed, or `http://<host>:<engine_port>` is outside the node allowlist |
| 400 `invalid_setup` | the body breaks a rule checkable here (`_preflight`: model, its presence, alias, sizing) |
| 409 `host_busy` | another operation (this gateway's, or another's sharing etcd) holds the host's lease |
| 409 `conflict` | the host is a registered node that is not `failed` (tear it down first) |
| 429 `too_many_setups` | `provisioning.max_concurrent_setups` setups run already (teardowns are never refused so) |

Every check runs before any power or SSH work. The host's lease is taken before the 202 and released exactly once
when the operation ends, however it ends (success, failure, cancellation); its fencing generation goes on every
record the operation writes, and an operation whose lease is lost stops (`LeaseLost`).

Operations survive their owner: `reconcile` (every `provisioning.reconcile_interval_s`, and at start-up) adopts
each running task no live gateway holds: its task is marked failed at the step it reached, its node failed, the run
it left on the host ended, and the host freed. Any gateway sharing etcd does so within `host_lease_ttl_s` plus one
interval of the owner's death; a restarted gateway does so for its own at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

from qiip_core._errors import (
    EndpointError,
    HostBusy,
    HostNotAllowed,
    LeaseLost,
    NodeConflict,
    NodeNotFound,
    ProvisioningError,
    QiipError,
    TooManySetups,
)
from qiip_core.config import Settings
from qiip_core.lifecycle import Fleet, Operation, OperationRunner, drain
from qiip_core.nodes import EndpointPolicy, Engine, NodeStatus
from qiip_core.provisioning._bundle import (
    LOCK_WAIT_S,
    bundle_files,
    bundle_parameters,
    end_previous_runs,
    engine_script_name,
)
from qiip_core.provisioning._logs import HostLogs
from qiip_core.provisioning._pipeline import PowerOn, SetupRequest, engine_started, run_setup
from qiip_core.provisioning._preflight import check_setup_request
from qiip_core.provisioning._record import TaskRecorder
from qiip_core.provisioning._redfish import PowerStatus, RedfishClient, ResetType
from qiip_core.provisioning._ssh import SshTarget, forget_host_key, open_ssh
from qiip_core.provisioning._tasks import (
    HostLease,
    ProvisioningTask,
    TaskState,
    TaskStore,
    create_task_store,
    utc_now,
)
from qiip_core.routing import RoutingTable

__all__ = ["Provisioner", "check_host", "gateway_owner"]

logger = logging.getLogger("qiip.provisioning")


FREED = "the host is free again"
"""The start of the host's log line a takeover ends with, once the host's lease is given back."""


def gateway_owner(settings: Settings) -> str:
    """This gateway's name in task records and host leases: `<host name>:<port>`, the same after a restart."""
    return f"{socket.gethostname()}:{settings.server.port}"


class Provisioner:
    """Setups, teardowns and their records for one daemon.

    Args:
        settings: the daemon's settings.
        fleet: where nodes are registered.
        table: the routing table (drains wait on it; conflicts are read from it).
        operations: the daemon's operation runner (ids, 202 answers, `/admin/operations/{id}`).
        store: task records and host leases; None: the backend of `registry.backend`.
        power_on: turns a host on through its BMC; None: the Redfish client's `On` when `redfish.bmc_url_template`
            is set (else no power-on step).
        redfish: the Redfish client; None: one made from `[redfish]`.

    Raises:
        ConfigError: `redfish.password_file` cannot be used.
    """

    def __init__(
        self,
        settings: Settings,
        fleet: Fleet,
        table: RoutingTable,
        operations: OperationRunner,
        *,
        store: TaskStore | None = None,
        power_on: PowerOn | None = None,
        redfish: RedfishClient | None = None,
    ) -> None:
        self.settings = settings
        self.p = settings.provisioning
        self.fleet = fleet
        self.table = table
        self.operations = operations
        self.store = store or create_task_store(settings, gateway_owner(settings))
        self._policy = settings.routing.endpoint_policy()
        self.redfish = redfish or RedfishClient.from_settings(settings.redfish, check_host=self.check_host)
        if power_on is None and self.redfish.configured:
            power_on = self._power_on
        self.power_on = power_on
        self.logs = HostLogs(
            max_entries=self.p.log_entries_per_host, max_bytes=self.p.log_bytes_per_host, max_hosts=self.p.log_hosts
        )
        self.known_hosts = self.p.known_hosts_file or settings.state_dir / "known_hosts"
        self._setups: set[str] = set()
        self._running: dict[str, str] = {}  # host -> operation id
        self._reconciler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- checks --------------------------------------------------------------------------------------------

    def check_host(self, hostname: str) -> str:
        """The host name, normalised, if a node there would pass the allowlist (nothing is resolved).

        Raises:
            HostNotAllowed: malformed, or outside `routing.allowed_endpoint_*` (with `provisioning.engine_port`).
        """
        return check_host(self._policy, self.p.engine_port, hostname)

    def _check_capacity(self, host: str) -> None:
        if len(self._setups) >= self.p.max_concurrent_setups:
            raise TooManySetups(
                f"{len(self._setups)} setups are running, the limit (provisioning.max_concurrent_setups); "
                f"retry {host} when one finishes.",
                host=host,
            )

    async def _lease(self, host: str, operation_id: str) -> HostLease:
        return await self.store.acquire(host, operation_id)

    # -- setup ---------------------------------------------------------------------------------------------

    async def start_setup(self, request: SetupRequest) -> Operation:
        """Check the request, take the host's lease and start the setup in the background.

        Raises:
            HostNotAllowed: the host is outside the allowlist.
            SetupInvalid: the body breaks a rule checkable here (model, alias, sizing; `.param` names the field).
            ConfigError: a pin cannot be checked (the cuda profile without a pinned driver, …).
            TooManySetups: the concurrent-setup limit is reached.
            NodeConflict: the host is a registered node that is not failed.
            HostBusy: another operation holds the host's lease.
        """
        host = self.check_host(request.hostname)
        request = await asyncio.to_thread(check_setup_request, self.settings, replace(request, hostname=host))
        bundle_parameters(self.settings, request.engine, model_alias=request.alias)
        self._check_capacity(host)
        operation_id = OperationRunner.new_id()
        lease = await self._lease(host, operation_id)
        try:
            superseded = await self._supersede(host, lease)
            state = self.table.get(host)
            if state is not None and not superseded and state.effective_node().status is not NodeStatus.FAILED:
                raise NodeConflict(
                    f"Host {host} is a registered node ({state.effective_node().status.value}); tear it down first."
                )
        except BaseException:
            await asyncio.shield(lease.release())
            raise
        self._setups.add(host)
        task = ProvisioningTask(
            hostname=host,
            kind="setup",
            engine=request.engine.value,
            model=request.model,
            operation_id=operation_id,
            owner=self.store.owner,
            generation=lease.generation,
            deployment=request.deployment,
        )

        async def work(operation: Operation) -> dict[str, Any]:
            record = TaskRecorder(self.store, self.logs, task, operation.log, lease)
            try:
                await record.save()
                record.log(f"setup of {request.engine.value} serving {request.alias!r} by {self.store.owner}")
                result = await run_setup(
                    self.settings,
                    self.fleet,
                    request,
                    record,
                    known_hosts=self.known_hosts,
                    power_on=self.power_on,
                )
                await record.finish(TaskState.SUCCEEDED)
                return result
            except asyncio.CancelledError:
                if lease.lost:
                    raise self._lost(record) from None
                await asyncio.shield(record.finish(TaskState.CANCELLED, error="cancelled by an operator"))
                raise
            except LeaseLost:
                raise self._lost(record) from None
            except ProvisioningError as exc:
                await record.finish(TaskState.FAILED, error=exc.message, failed_step=exc.step)
                raise
            except QiipError as exc:
                await record.finish(TaskState.FAILED, error=exc.message)
                raise
            except Exception as exc:
                await record.finish(TaskState.FAILED, error=f"internal error: {exc!r}")
                raise
            finally:
                self._setups.discard(host)
                self._running.pop(host, None)
                await asyncio.shield(lease.release())

        return self._start("setup", host, work, operation_id, lease)

    def _lost(self, record: TaskRecorder) -> LeaseLost:
        """The error of an operation whose lease was lost: it writes nothing more (the record is the new owner's)."""
        message = (
            f"The lease of host {record.host} was lost during step {record.step_name}; the operation stopped and "
            "left the host to the gateway that took it over."
        )
        record.log(message, "error")
        return LeaseLost(message, host=record.host, step=record.step_name)

    async def _supersede(self, host: str, lease: HostLease) -> bool:
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
        return task.kind == "setup" and await self._fail_node(host)

    async def _fail_node(self, host: str) -> bool:
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

    def _start(
        self,
        kind: str,
        host: str,
        work: Callable[[Operation], Awaitable[dict[str, Any]]],
        operation_id: str,
        lease: HostLease,
    ) -> Operation:
        try:
            operation = self.operations.start(kind, host, work, operation_id=operation_id)
        except NodeConflict:
            self._setups.discard(host)
            asyncio.get_running_loop().create_task(lease.release())
            raise
        self._running[host] = operation.id
        # The host's log exists from the 202 on, so a follower asking at once is not told there is none.
        self.logs.append(host, f"{kind} {operation.id} accepted by {self.store.owner}", step=None)

        def stop() -> None:
            # A lease that the backend stops confirming stops the operation at once, not at its next step.
            self.operations.cancel(operation.id)

        lease.on_lost = stop
        return operation

    # -- teardown ------------------------------------------------------------------------------------------

    async def start_teardown(
        self,
        node_id: str,
        *,
        force: bool,
        recovery_engine: Engine | None = None,
        reason: str | None = None,
        forget_host_key: bool = False,
    ) -> Operation:
        """Tear a provisioned node down in the background: drain, stop the engine, deregister.

        Args:
            node_id: the node (its host name).
            force: skip the drain, stop the engine with SIGKILL; with `recovery_engine`, a host whose
                registration was lost.
            recovery_engine: the engine to stop when the node is not registered any more.
            reason: why the teardown runs, written first to the host's log (an operator's teardown has none; the
                QUADS enforcement names the reservation).
            forget_host_key: remove the host's entry from the known-hosts file once torn down (a host QUADS lends
                is re-imaged before its next loan, with a new key).

        Raises:
            HostNotAllowed: the host is outside the allowlist.
            NodeNotFound: not registered, and no `recovery_engine` with `force`.
            HostBusy: another operation holds the host's lease.
        """
        host = self.check_host(node_id)
        state = self.table.get(node_id)
        if state is None and not (force and recovery_engine is not None):
            raise NodeNotFound(node_id)
        engine = state.effective_node().engine if state is not None else recovery_engine
        assert engine is not None
        operation_id = OperationRunner.new_id()
        lease = await self._lease(host, operation_id)
        try:
            await self._supersede(host, lease)
        except BaseException:
            await asyncio.shield(lease.release())
            raise
        task = ProvisioningTask(
            hostname=host, kind="teardown", engine=engine.value, current_step="draining", operation_id=operation_id,
            owner=self.store.owner, generation=lease.generation,
            deployment=state.effective_node().deployment if state is not None else None,
        )  # fmt: skip

        async def work(operation: Operation) -> dict[str, Any]:
            record = TaskRecorder(self.store, self.logs, task, operation.log, lease)
            try:
                await record.save()
                if reason is not None:
                    record.log(reason, "warning")
                result = await self._teardown(record, operation, node_id, engine, force=force)
                if forget_host_key:
                    removed = await self._forget_key(host)
                    record.log(f"removed {removed} host key entr{'y' if removed == 1 else 'ies'} of {host}: the host "
                               "is re-imaged before it is lent again")  # fmt: skip
                await record.finish(TaskState.SUCCEEDED)
                return result
            except asyncio.CancelledError:
                if lease.lost:
                    raise self._lost(record) from None
                await asyncio.shield(record.finish(TaskState.CANCELLED, error="cancelled by an operator"))
                raise
            except LeaseLost:
                raise self._lost(record) from None
            except QiipError as exc:
                await record.finish(TaskState.FAILED, error=exc.message)
                raise
            finally:
                self._running.pop(host, None)
                await asyncio.shield(lease.release())

        return self._start("teardown", host, work, operation_id, lease)

    async def _teardown(
        self, record: TaskRecorder, operation: Operation, node_id: str, engine: Engine, *, force: bool
    ) -> dict[str, Any]:
        remaining = 0
        if self.table.get(node_id) is not None and not force:
            timeout_s = self.settings.admin.drain_timeout_s
            with contextlib.suppress(NodeNotFound):
                drained = await drain(self.table, self.fleet, node_id, timeout_s=timeout_s, log=operation.log)
                remaining = drained["remaining_in_flight"]
            record.log(f"drained ({remaining} request(s) still in flight)")
        await record.step("stopping_engine")
        target = SshTarget.for_host(record.host, self.p, known_hosts=self.known_hosts)
        name = engine_script_name(engine)
        async with open_ssh(target, run_tag=record.run_tag) as ssh:
            for ended in await end_previous_runs(ssh, lock_wait_s=LOCK_WAIT_S):
                record.log(f"ended an earlier run left on the host: {ended}", "warning")
            root = (await ssh.output('printf "%s" "${QIIPNODE_ROOT:-}"', what="reading the install root")).rstrip("/")
            await ssh.upload(bundle_files(), root + self.p.remote_dir)
            args = [name, "--force"] if force else [name]
            command = bundle_parameters_for_stop(self.p.remote_dir, args)

            def on_line(line: str, stream: str) -> None:
                record.log(line, "info", "stdout" if stream == "stdout" else "stderr")

            result = await ssh.run(
                command, on_line=on_line, total_timeout_s=120.0, idle_timeout_s=90.0, what="stop-engine.sh"
            )
            if result.exit_status != 0:
                raise ProvisioningError(
                    f"stop-engine.sh exited with {result.exit_status} on {record.host}.",
                    host=record.host,
                    step="stopping_engine",
                )
        await record.step("deregistering")
        try:
            await self.fleet.deregister(node_id)
        except NodeNotFound:
            if not force:
                raise
            record.log("no registration was left to remove")
        return {"remaining_in_flight": remaining, "forced": force}

    # -- power ---------------------------------------------------------------------------------------------

    async def power_state(self, hostname: str) -> PowerStatus:
        """The host's power state as its BMC reports it (DMTF Redfish `ComputerSystem.PowerState`).

        Raises:
            HostNotAllowed: outside the allowlist (before any name is resolved).
            PowerNotConfigured: no `redfish.bmc_url_template`.
            RedfishError: the BMC cannot be used (its subclasses say why).
        """
        return await self.redfish.power_state(self.check_host(hostname))

    async def power(self, hostname: str, reset_type: ResetType) -> PowerStatus:
        """Reset the host's system (DMTF Redfish `ComputerSystem.Reset`) under its lease, so never during its setup
        or teardown.

        Returns:
            The system and its power state just before the action.

        Raises:
            HostNotAllowed: outside the allowlist (before any name is resolved or lease taken).
            PowerNotConfigured: no `redfish.bmc_url_template`.
            HostBusy: another operation holds the host's lease.
            RedfishError: the BMC cannot be used or refuses the reset type (its subclasses say why).
        """
        host = self.check_host(hostname)
        self.redfish.bmc_url(host)  # refuse an unconfigured BMC before taking the lease
        lease = await self._lease(host, OperationRunner.new_id())
        try:
            return await self.redfish.reset(host, reset_type)
        finally:
            await asyncio.shield(lease.release())

    async def _power_on(self, host: str) -> None:
        await self.redfish.reset(host, ResetType.ON)

    # -- operations and records ----------------------------------------------------------------------------

    def cancel(self, host: str) -> Operation:
        """Cancel the operation running on `host`: its remote command is stopped and its lease released.

        Raises:
            NodeNotFound: no operation of this gateway runs on the host.
        """
        operation_id = self._running.get(host)
        operation = self.operations.get(operation_id) if operation_id else None
        if operation is None or not self.operations.cancel(operation.id):
            raise NodeNotFound(host)
        return operation

    async def is_provisioned(self, node_id: str) -> bool:
        """True when `node_id` is a host set up (or torn down) over SSH: it has a task record."""
        try:
            task = await self.store.get(node_id)
        except QiipError:
            return False
        return task is not None

    def running_setups(self) -> int:
        """Setups running now."""
        return len(self._setups)

    async def tasks(self) -> list[ProvisioningTask]:
        """Every task record, sorted by host."""
        return await self.store.list_tasks()

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
            await self._fail_node(host)
        return failed

    async def _end_remote(self, task: ProvisioningTask, lease: HostLease) -> None:
        """End the run an adopted task left on its host (and the engine of a setup that had started it), then free
        the host; an unreachable host is left to the next operation's first step."""
        host = task.hostname
        tag = f"{lease.operation_id} gen {lease.generation}"
        try:
            async with asyncio.timeout(self.p.connect_timeout_s + LOCK_WAIT_S + 90.0):
                target = SshTarget.for_host(host, self.p, known_hosts=self.known_hosts)
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
                    await self._fail_node(task.hostname)

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> None:
        job = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._background.add(job)
        job.add_done_callback(self._background.discard)

    async def forget_host_key(self, hostname: str) -> int:
        """Remove the host's entries from the known-hosts file (`provisioning.known_hosts_file`): after a host is
        re-imaged its key changes, and SSH refuses it until the old entry goes.

        Returns:
            How many entries were removed (0: there were none).

        Raises:
            HostNotAllowed: outside the allowlist.
            ProvisioningError: the file cannot be rewritten.
        """
        host = self.check_host(hostname)
        return await self._forget_key(host)

    async def _forget_key(self, host: str) -> int:
        try:
            removed = await asyncio.to_thread(forget_host_key, self.known_hosts, host, self.p.ssh_port)
        except OSError as exc:
            raise ProvisioningError(
                f"The known-hosts file {self.known_hosts} cannot be rewritten ({exc.strerror or exc}).", host=host
            ) from exc
        logger.warning("host key of %s forgotten: %d entr%s removed from %s", host, removed,
                       "y" if removed == 1 else "ies", self.known_hosts)  # fmt: skip
        return removed

    async def aclose(self) -> None:
        """End log followers and takeovers, stop refreshing leases, close the BMC connections."""
        self.logs.close()
        jobs = [*self._background, *([self._reconciler] if self._reconciler is not None else [])]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self._reconciler = None
        await self.store.aclose()
        await self.redfish.aclose()


def check_host(policy: EndpointPolicy, engine_port: int, hostname: str) -> str:
    """The host name, normalised, if a node at `http://<hostname>:<engine_port>` would pass `policy` (nothing is
    resolved: the check reads the name only).

    Raises:
        HostNotAllowed: malformed, or outside the allowlist.
    """
    raw = hostname.strip().lower().rstrip(".")
    if not raw or any(c in raw for c in "/@?#[] \t{}") or raw.startswith("-"):
        raise HostNotAllowed(f"{hostname!r} is not a host name or address.", host=hostname)
    try:
        endpoint = policy.check(f"http://{raw}:{engine_port}")
    except EndpointError as exc:
        raise HostNotAllowed(
            f"Host {raw} cannot be provisioned: {exc.message} (the node would serve at http://{raw}:{engine_port})",
            host=raw,
        ) from exc
    return endpoint.host


def bundle_parameters_for_stop(remote_dir: str, args: list[str]) -> str:
    """The command that runs the uploaded `stop-engine.sh` with `args`."""
    path = f'"${{QIIPNODE_ROOT:-}}"{shlex.quote(remote_dir + "/stop-engine.sh")}'
    return f"bash {path} {' '.join(shlex.quote(a) for a in args)}"

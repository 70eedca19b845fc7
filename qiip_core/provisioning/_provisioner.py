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
each running task no live gateway holds, through the provisioner's `Takeover` (`_takeover`): its task is marked
failed at the step it reached, its node failed, the run it left on the host ended, and the host freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from qiip_core._errors import (
    EndpointError,
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
from qiip_core.provisioning._pipeline import PowerOn, SetupRequest, run_setup
from qiip_core.provisioning._preflight import check_setup_request
from qiip_core.provisioning._record import TaskRecorder
from qiip_core.provisioning._redfish import PowerStatus, RedfishClient, ResetType
from qiip_core.provisioning._ssh import SshTarget, forget_host_key, open_ssh
from qiip_core.provisioning._takeover import Takeover
from qiip_core.provisioning._tasks import (
    HostLease,
    ProvisioningTask,
    TaskState,
    TaskStore,
    create_task_store,
)
from qiip_core.routing import RoutingTable

__all__ = ["Provisioner", "check_host", "gateway_owner"]

logger = logging.getLogger("qiip.provisioning")


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
        self.redfish = redfish or RedfishClient.from_settings(
            settings.redfish, check_host=self.check_host, networks=settings.routing.endpoint_policy().networks
        )
        if power_on is None and self.redfish.configured:
            power_on = self._power_on
        self.power_on = power_on
        self.logs = HostLogs(
            max_entries=self.p.log_entries_per_host, max_bytes=self.p.log_bytes_per_host, max_hosts=self.p.log_hosts
        )
        self.known_hosts = self.p.known_hosts_file or settings.state_dir / "known_hosts"
        self._setups: set[str] = set()
        self._running: dict[str, str] = {}  # host -> operation id
        self._takeover = Takeover(
            self.p, self.store, self.logs, table, fleet, running=self._running, target=self._target
        )

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

    def _target(self, host: str) -> SshTarget:
        return SshTarget.for_host(host, self.p, known_hosts=self.known_hosts)

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
            superseded = await self._takeover.supersede(host, lease)
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
            await self._takeover.supersede(host, lease)
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

    async def tasks(self) -> list[ProvisioningTask]:
        """Every task record, sorted by host."""
        return await self.store.list_tasks()

    async def recover(self) -> list[ProvisioningTask]:
        """Adopt what a gateway that died left running, then keep doing so (`Takeover.recover`).

        Returns:
            The tasks adopted now.

        Raises:
            QiipError: the task records cannot be read (the loop still starts and tries again).
        """
        return await self._takeover.recover()

    async def reconcile(self) -> list[ProvisioningTask]:
        """One level-triggered takeover pass (`Takeover.reconcile`).

        Returns:
            The tasks adopted in this pass.

        Raises:
            QiipError: the task records cannot be read.
        """
        return await self._takeover.reconcile()

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
        await self._takeover.aclose()
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

"""One operation's task record and log: each step persisted in the task store, each line in the host's log.

`TaskRecorder` is what the setup and teardown pipelines write through, so the record an operator (or the next
gateway) reads and the live log always agree on the step. Every write is fenced by the operation's host lease:
a step whose lease is lost, or whose generation another operation has passed, raises `LeaseLost` and the
operation stops there.
"""

from __future__ import annotations

import logging

from qiip_core._errors import RegistryUnavailable, safe_text
from qiip_core.lifecycle import OperationLog
from qiip_core.provisioning._logs import HostLogs, LogStream
from qiip_core.provisioning._tasks import HostLease, ProvisioningTask, TaskState, TaskStore, utc_now

__all__ = ["TaskRecorder"]

logger = logging.getLogger("qiip.provisioning")


class TaskRecorder:
    """Writes one operation's task record and log lines.

    Args:
        store: where the record lives.
        logs: the hosts' logs.
        task: the record, as started (its `generation` the lease's).
        operation_log: the daemon operation's log, which gets the gateway's own lines too.
        lease: the operation's host lease; each step checks it.
    """

    def __init__(
        self,
        store: TaskStore,
        logs: HostLogs,
        task: ProvisioningTask,
        operation_log: OperationLog | None = None,
        lease: HostLease | None = None,
    ) -> None:
        self.store = store
        self.logs = logs
        self.task = task
        self.operation_log = operation_log
        self.lease = lease

    @property
    def run_tag(self) -> str:
        """What the host records beside each of this operation's commands: `<operation id> gen <generation>`."""
        return f"{self.task.operation_id or '-'} gen {self.task.generation or 0}"

    @property
    def host(self) -> str:
        """The host."""
        return self.task.hostname

    @property
    def step_name(self) -> str:
        """The step the operation is at."""
        return self.task.current_step

    async def save(self) -> None:
        """Write the record (a backend failure is logged: the operation goes on while its lease holds).

        Raises:
            LeaseLost: the lease is lost or a newer generation holds the host.
        """
        if self.lease is not None:
            self.lease.check()
        try:
            await self.store.put(self.task)
        except RegistryUnavailable as exc:
            logger.warning("the task record of %s could not be written: %s", self.host, exc.message)

    async def step(self, name: str) -> None:
        """Move to step `name` and record it.

        Raises:
            LeaseLost: the lease is lost or a newer generation holds the host: the operation must stop.
        """
        if self.lease is not None:
            self.lease.check()
        if name == self.task.current_step:
            return
        self.task = self.task.model_copy(update={"current_step": name, "updated_at": utc_now()})
        self.log(f"step {name}")
        await self.save()

    def log(self, msg: str, level: str = "info", stream: LogStream = "gateway") -> None:
        """Add a line to the host's log (and, for the gateway's own lines, the operation's log), credentials in URLs
        and headers redacted, control characters escaped."""
        msg = safe_text(msg, limit=4096)
        self.logs.append(self.host, msg, level=level, stream=stream, step=self.task.current_step)
        if stream == "gateway" and self.operation_log is not None:
            self.operation_log(f"{self.host}: {msg}", "warning" if level in ("warning", "error") else "info")

    async def finish(self, state: TaskState, *, error: str | None = None, failed_step: str | None = None) -> None:
        """Record how the operation ended."""
        update: dict[str, object] = {"state": state, "updated_at": utc_now(), "error": error}
        if state is TaskState.SUCCEEDED:
            update["current_step"] = "complete" if self.task.kind == "setup" else "teardown_complete"
        else:
            update["failed_step"] = failed_step or self.task.current_step
        self.task = self.task.model_copy(update=update)
        level = "info" if state is TaskState.SUCCEEDED else "error"
        self.log(f"{self.task.kind} {state.value}" + (f": {error}" if error else ""), level)
        await self.save()

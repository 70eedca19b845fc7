"""Provisioning task records and host leases, in the registry's backend: the state directory or etcd.

A task record says where an operation on a host is, for operators and for the next gateway to start:

```
{"hostname": "gpu01", "kind": "setup", "state": "running", "current_step": "nvidia_driver",
 "started_at": …, "updated_at": …, "failed_step": null, "error": null, "engine": "vllm", "model": …,
 "operation_id": "op_…", "owner": "gw1:8080"}
```

(`hostname`, `current_step`, `started_at`, `updated_at`, `failed_step`, `error` are the seed system's record.)

A host lease makes an operation the only one on its host: across this daemon, and across every gateway sharing
etcd. `TaskStore.acquire` takes it or raises `HostBusy`; `HostLease.release` gives it back exactly once.

- Embedded (`<state_dir>/provisioning.json`, a `LockedJsonFile`): the lease is the running task record of the
  host, taken under the file's lock.
- etcd: tasks at `<etcd.provisioning_prefix><host>`; the lease is the key `/provisioning-leases/<host>` (the
  provisioning prefix with `-leases`) created by a transaction only if absent, with an etcd lease of
  `provisioning.host_lease_ttl_s` refreshed every third of it. A gateway that dies stops refreshing, and the host
  is free once the TTL runs out.

`recover()` runs at start-up: a task still `running` that no live gateway holds (its owner is this gateway from
before a crash, or its etcd lease is gone) is marked `failed` with the step where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from etcd3gw.lease import Lease
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiip_core._errors import HostBusy, RegistryUnavailable
from qiip_core.storage import EtcdClient, LockedJsonFile, b64, load_json_object, unb64

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = [
    "TASK_FILE_NAME",
    "EmbeddedTaskStore",
    "EtcdTaskStore",
    "HostLease",
    "ProvisioningTask",
    "TaskState",
    "TaskFile",
    "TaskStore",
    "create_task_store",
]

logger = logging.getLogger("qiip.provisioning")

TASK_FILE_NAME = "provisioning.json"
"""The embedded task file's name under the state directory."""


def utc_now() -> datetime:
    """The current time in UTC."""
    return datetime.now(UTC)


class TaskState(StrEnum):
    """Where a provisioning task is."""

    RUNNING = "running"
    """An operation works on the host."""
    SUCCEEDED = "succeeded"
    """It finished as asked."""
    FAILED = "failed"
    """It stopped at `failed_step`, for `error`."""
    CANCELLED = "cancelled"
    """An operator cancelled it; its remote command was stopped."""


class ProvisioningTask(BaseModel):
    """The record of the last operation on one host."""

    model_config = ConfigDict(extra="ignore")

    hostname: str = Field(min_length=1, max_length=253)
    """The host."""
    kind: Literal["setup", "teardown"] = "setup"
    """What the operation does."""
    state: TaskState = TaskState.RUNNING
    """running, succeeded, failed or cancelled."""
    current_step: str = "pending"
    """The step it is at (`qiip_core.provisioning.SETUP_STEPS`, `TEARDOWN_STEPS`)."""
    started_at: datetime = Field(default_factory=utc_now)
    """When it started (UTC)."""
    updated_at: datetime = Field(default_factory=utc_now)
    """When the record last changed (UTC)."""
    failed_step: str | None = None
    """The step that failed."""
    error: str | None = None
    """Why it failed."""
    engine: str | None = None
    """The engine set up or torn down (`vllm`, `llama_cpp`)."""
    model: str | None = None
    """The model asked for."""
    operation_id: str | None = None
    """The daemon's operation (`/admin/operations/{id}`)."""
    owner: str | None = None
    """The gateway running it (`<host name>:<port>`)."""

    @property
    def id(self) -> str:
        """The record's key: the host name."""
        return self.hostname

    def view(self) -> dict[str, Any]:
        """The record as JSON, with `elapsed_s` (to now while it runs)."""
        end = self.updated_at if self.state is not TaskState.RUNNING else utc_now()
        return {**self.model_dump(mode="json"), "elapsed_s": round((end - self.started_at).total_seconds(), 3)}


class HostLease(ABC):
    """One operation's hold on a host. Release it exactly once (`release` is idempotent)."""

    host: str

    @abstractmethod
    async def release(self) -> None:
        """Free the host."""


class TaskStore(ABC):
    """Where task records and host leases live.

    Args:
        owner: this gateway's name in records and leases (`<host name>:<port>`).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner

    @abstractmethod
    async def put(self, task: ProvisioningTask) -> None:
        """Write a task record.

        Raises:
            RegistryUnavailable: the backend cannot be written.
        """

    @abstractmethod
    async def list_tasks(self) -> list[ProvisioningTask]:
        """Every task record, sorted by host."""

    async def get(self, host: str) -> ProvisioningTask | None:
        """The task record of `host`, if any."""
        return next((t for t in await self.list_tasks() if t.hostname == host), None)

    @abstractmethod
    async def acquire(self, host: str, operation_id: str) -> HostLease:
        """Take `host`'s lease for an operation.

        Raises:
            HostBusy: another operation holds it (the message names the holder).
            RegistryUnavailable: the backend cannot be used.
        """

    @abstractmethod
    async def recover(self) -> list[ProvisioningTask]:
        """Mark the running tasks no live gateway holds as failed. Returns the tasks it marked."""

    async def aclose(self) -> None:
        """Stop refreshing leases (they are released by their operations)."""
        return None


def _stale(task: ProvisioningTask, why: str) -> ProvisioningTask:
    return task.model_copy(
        update={
            "state": TaskState.FAILED,
            "failed_step": task.current_step,
            "error": f"The gateway {task.owner} stopped during step {task.current_step} ({why}); run the setup again.",
            "updated_at": utc_now(),
        }
    )


# -- embedded ------------------------------------------------------------------------------------------------


class TaskFile(LockedJsonFile[ProvisioningTask]):
    """`<state_dir>/provisioning.json`: `{"version": 1, "tasks": [<task>, …]}`."""

    file_name = TASK_FILE_NAME
    items_key = "tasks"
    model = ProvisioningTask
    noun = "provisioning task file"
    fresh_start = "start with no task records"
    entry_noun = "task"
    error = RegistryUnavailable
    log = logger


class _EmbeddedLease(HostLease):
    def __init__(self, store: EmbeddedTaskStore, host: str) -> None:
        self.store = store
        self.host = host
        self._released = False

    async def release(self) -> None:
        if not self._released:
            self._released = True
            self.store._held.discard(self.host)


class EmbeddedTaskStore(TaskStore):
    """Task records in the state directory; leases held by this daemon (one daemon per state directory)."""

    def __init__(self, settings: Settings, owner: str) -> None:
        super().__init__(owner)
        self.file = TaskFile(settings.state_dir)
        self._held: set[str] = set()

    async def put(self, task: ProvisioningTask) -> None:
        await asyncio.to_thread(self.file.update, lambda tasks: {**tasks, task.hostname: task})

    async def list_tasks(self) -> list[ProvisioningTask]:
        tasks = await asyncio.to_thread(self.file.read)
        return [tasks[k] for k in sorted(tasks)]

    async def acquire(self, host: str, operation_id: str) -> HostLease:
        if host in self._held:
            raise HostBusy(f"Host {host} is busy with another operation of this gateway; wait for it.", host=host)
        self._held.add(host)
        return _EmbeddedLease(self, host)

    async def recover(self) -> list[ProvisioningTask]:
        marked: list[ProvisioningTask] = []

        def change(tasks: dict[str, ProvisioningTask]) -> dict[str, ProvisioningTask]:
            for host, task in tasks.items():
                if task.state is TaskState.RUNNING and task.owner == self.owner and host not in self._held:
                    tasks[host] = _stale(task, "this gateway restarted")
                    marked.append(tasks[host])
            return tasks

        await asyncio.to_thread(self.file.update, change)
        return marked


# -- etcd ----------------------------------------------------------------------------------------------------


class _EtcdLease(HostLease):
    def __init__(self, store: EtcdTaskStore, host: str, lease_id: int) -> None:
        self.store = store
        self.host = host
        self.lease_id = lease_id
        self._refresh = asyncio.create_task(self._keep_alive(), name=f"qiip-host-lease-{host}")
        self._released = False

    async def _keep_alive(self) -> None:
        interval = self.store.ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                ttl = await asyncio.to_thread(self.store.client.refresh, self.lease_id)
                if ttl <= 0:
                    logger.error("the etcd lease of host %s expired while its operation ran", self.host)
            except RegistryUnavailable as exc:
                logger.warning("could not refresh the lease of host %s: %s", self.host, exc.message)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._refresh.cancel()
        try:
            await asyncio.to_thread(self.store.revoke, self.lease_id)
        except RegistryUnavailable as exc:
            logger.warning("could not release the lease of host %s (it expires by itself): %s", self.host, exc.message)


class EtcdTaskStore(TaskStore):
    """Task records and host leases in etcd, shared by every gateway of the fleet."""

    def __init__(self, settings: Settings, owner: str) -> None:
        super().__init__(owner)
        self.client = EtcdClient(settings.etcd)
        self.prefix = settings.etcd.provisioning_prefix.encode()
        self.lease_prefix = settings.etcd.provisioning_prefix.rstrip("/").encode() + b"-leases/"
        self.ttl_s = settings.provisioning.host_lease_ttl_s
        self.max_value_bytes = settings.etcd.max_value_bytes

    async def put(self, task: ProvisioningTask) -> None:
        value = json.dumps(task.model_dump(mode="json"), separators=(",", ":")).encode()
        await asyncio.to_thread(self.client.put, self.prefix + task.hostname.encode(), value)

    async def list_tasks(self) -> list[ProvisioningTask]:
        _, kvs = await asyncio.to_thread(self.client.range_prefix, self.prefix)
        tasks = []
        for kv in kvs:
            key = unb64(kv["key"]).decode(errors="replace")
            try:
                data = load_json_object(unb64(kv.get("value", "")), max_value_bytes=self.max_value_bytes)
                tasks.append(ProvisioningTask.model_validate(data))
            except (ValueError, ValidationError) as exc:
                logger.warning("skipping the provisioning record %s: %s", key, exc)
        return sorted(tasks, key=lambda t: t.hostname)

    def _holder(self, host: str) -> dict[str, Any] | None:
        key = self.lease_prefix + host.encode()
        result = self.client.call(lambda c: c.post(c.get_url("/kv/range"), json={"key": b64(key)}))
        kvs = result.get("kvs") or []
        if not kvs:
            return None
        try:
            holder: dict[str, Any] = json.loads(unb64(kvs[0].get("value", "")))
        except ValueError:
            holder = {}
        holder["lease"] = int(kvs[0].get("lease", 0) or 0)
        return holder

    def _take(self, host: str, operation_id: str) -> int | None:
        key = self.lease_prefix + host.encode()
        value = json.dumps({"owner": self.owner, "operation_id": operation_id}).encode()

        def txn(client: Any) -> int | None:
            lease = client.lease(ttl=self.ttl_s)
            result = client.transaction(
                {
                    "compare": [{"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                    "success": [{"request_put": {"key": b64(key), "value": b64(value), "lease": lease.id}}],
                    "failure": [],
                }
            )
            if not result.get("succeeded"):
                lease.revoke()
                return None
            return int(lease.id)

        lease_id: int | None = self.client.call(txn)
        return lease_id

    def revoke(self, lease_id: int) -> None:
        """Revoke an etcd lease (its lease key goes with it)."""
        self.client.call(lambda c: Lease(lease_id, c).revoke())

    async def acquire(self, host: str, operation_id: str) -> HostLease:
        lease_id = await asyncio.to_thread(self._take, host, operation_id)
        if lease_id is None:
            holder = await asyncio.to_thread(self._holder, host) or {}
            raise HostBusy(
                f"Host {host} is busy: operation {holder.get('operation_id', '?')} of gateway "
                f"{holder.get('owner', '?')} holds its lease; wait for it to finish.",
                host=host,
            )
        return _EtcdLease(self, host, lease_id)

    async def recover(self) -> list[ProvisioningTask]:
        marked = []
        for task in await self.list_tasks():
            if task.state is not TaskState.RUNNING:
                continue
            holder = await asyncio.to_thread(self._holder, task.hostname)
            if holder is None:
                why = "its host lease expired"
            elif holder.get("owner") == self.owner:
                why = "this gateway restarted"
                await asyncio.to_thread(self.revoke, holder["lease"])
            else:
                continue
            stale = _stale(task, why)
            await self.put(stale)
            marked.append(stale)
        return marked


def create_task_store(settings: Settings, owner: str) -> TaskStore:
    """The task store of `registry.backend`: the state directory's file, or etcd.

    Args:
        settings: the daemon's settings.
        owner: this gateway's name in records and leases.
    """
    if settings.registry.backend == "etcd":
        return EtcdTaskStore(settings, owner)
    return EmbeddedTaskStore(settings, owner)

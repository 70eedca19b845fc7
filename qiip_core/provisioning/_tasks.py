"""Provisioning task records and host leases, in the registry's backend: the state directory or etcd.

A task record says where an operation on a host is, for operators and for the next gateway to start:

```
{"hostname": "gpu01", "kind": "setup", "state": "running", "current_step": "nvidia_driver",
 "started_at": …, "updated_at": …, "failed_step": null, "error": null, "engine": "vllm", "model": …,
 "operation_id": "op_…", "owner": "gw1:8080", "generation": 17}
```

(`hostname`, `current_step`, `started_at`, `updated_at`, `failed_step`, `error` are the seed system's record.)

A host lease makes an operation the only one on its host: across this daemon, and across every gateway sharing
etcd. `TaskStore.acquire` takes it or raises `HostBusy`; `HostLease.release` gives it back exactly once. Every
lease carries a fencing generation, larger than any before it on that host, and every record an operation writes
carries its lease's generation: a write whose generation is not the host's current one is refused (`LeaseLost`),
so an owner that lost its lease (a stalled gateway whose host another one took over) can change nothing.

- Embedded (`<state_dir>/provisioning.json`, a `LockedJsonFile`): the lease is an exclusive `flock` on
  `<state_dir>/provisioning-leases/<host>`, held by the daemon's process while the operation runs, so the kernel
  frees it the moment that process dies (a `kill -9` included); the file keeps the last holder and generation.
- etcd: tasks at `<etcd.provisioning_prefix><host>`; the lease is the key `/provisioning-leases/<host>` (the
  provisioning prefix with `-leases`) created by a transaction only if absent, with an etcd lease of
  `provisioning.host_lease_ttl_s` refreshed every third of it; its creation revision is the generation, and a
  record is written only in a transaction that compares it. A gateway that dies stops refreshing, and the host
  is free once the TTL runs out.

`stale()` lists the running tasks no live operation holds (their owner died, or is this gateway before a restart);
the provisioner adopts them (`Provisioner.reconcile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiip_core._errors import HostBusy, LeaseLost, RegistryUnavailable
from qiip_core._lazy import LazyModule
from qiip_core.nodes import DeploymentRef
from qiip_core.storage import EtcdClient, LockedJsonFile, b64, load_json_object, unb64

if TYPE_CHECKING:
    from etcd3gw import lease as etcd_lease
else:
    etcd_lease = LazyModule("etcd3gw.lease")  # loaded with the first etcd lease

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = [
    "LEASE_DIR_NAME",
    "TASK_FILE_NAME",
    "EmbeddedTaskStore",
    "EtcdTaskStore",
    "HostLease",
    "ProvisioningTask",
    "TaskFile",
    "TaskState",
    "TaskStore",
    "create_task_store",
]

logger = logging.getLogger("qiip.provisioning")

TASK_FILE_NAME = "provisioning.json"
"""The embedded task file's name under the state directory."""

LEASE_DIR_NAME = "provisioning-leases"
"""The directory of the embedded host leases under the state directory."""


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
    generation: int | None = None
    """The fencing generation of the host lease the operation held when it wrote the record; None: a record of
    an older gateway, never fenced."""
    deployment: DeploymentRef | None = None
    """The deployment whose replica the operation sets up or tears down, when its controller started it."""
    interrupted: bool = False
    """It failed because its gateway died (or restarted) and another gateway took the host over, not because of the
    host or what it was asked to run."""

    @property
    def id(self) -> str:
        """The record's key: the host name."""
        return self.hostname

    def view(self) -> dict[str, Any]:
        """The record as JSON, with `elapsed_s` (to now while it runs)."""
        end = self.updated_at if self.state is not TaskState.RUNNING else utc_now()
        return {**self.model_dump(mode="json"), "elapsed_s": round((end - self.started_at).total_seconds(), 3)}


class HostLease(ABC):
    """One operation's hold on a host, with its fencing generation. Release it exactly once (`release` is
    idempotent).

    Attributes:
        host: the host.
        operation_id: the operation holding it.
        generation: the fencing token: larger than every earlier lease's on this host.
        lost: True once the backend no longer confirms the lease (an etcd lease that expired or could not be
            refreshed for its whole TTL); the operation must stop.
        on_lost: called once, on the event loop, when `lost` becomes True (the provisioner cancels the operation).
    """

    host: str
    operation_id: str
    generation: int
    lost: bool = False
    on_lost: Callable[[], None] | None = None

    def check(self) -> None:
        """Raise when the lease is lost.

        Raises:
            LeaseLost: the backend no longer confirms the lease.
        """
        if self.lost:
            raise LeaseLost(
                f"The lease of host {self.host} (generation {self.generation}) is gone; the operation stopped "
                "(another gateway may have taken the host over).",
                host=self.host,
            )

    def _mark_lost(self, why: str) -> None:
        if self.lost:
            return
        self.lost = True
        logger.error("the lease of host %s (generation %d) is lost: %s", self.host, self.generation, why)
        if self.on_lost is not None:
            self.on_lost()

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
        self.instance = os.urandom(6).hex()
        """This process's lease holder id: the same owner after a restart is another instance."""

    @abstractmethod
    async def put(self, task: ProvisioningTask) -> None:
        """Write a task record; fenced when `task.generation` is set.

        Raises:
            LeaseLost: a newer generation holds the host (or the lease of `task.generation` is gone).
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
        """Take `host`'s lease for an operation, with a new fencing generation.

        Raises:
            HostBusy: another operation holds it (the message names the holder).
            RegistryUnavailable: the backend cannot be used.
        """

    @abstractmethod
    async def stale(self) -> list[tuple[ProvisioningTask, str]]:
        """The running tasks no live operation holds, each with why (`its host lease expired`, `this gateway
        restarted`): the tasks to adopt."""

    async def aclose(self) -> None:
        """Stop refreshing leases (they are released by their operations)."""
        return None


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
    def __init__(self, host: str, operation_id: str, generation: int, fd: int) -> None:
        self.host = host
        self.operation_id = operation_id
        self.generation = generation
        self._fd: int | None = fd

    async def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases the flock


class EmbeddedTaskStore(TaskStore):
    """Task records in the state directory; leases are `flock`s held by the daemon's process."""

    def __init__(self, settings: Settings, owner: str) -> None:
        super().__init__(owner)
        self.file = TaskFile(settings.state_dir)
        self.lease_dir = settings.state_dir / LEASE_DIR_NAME

    def _lease_path(self, host: str) -> Path:
        return self.lease_dir / urllib.parse.quote(host, safe="")

    async def put(self, task: ProvisioningTask) -> None:
        def change(tasks: dict[str, ProvisioningTask]) -> dict[str, ProvisioningTask]:
            current = tasks.get(task.hostname)
            if _newer(current, task):
                assert current is not None
                raise LeaseLost(
                    f"Host {task.hostname} was taken over by operation {current.operation_id} of {current.owner} "
                    f"(generation {current.generation}); this operation (generation {task.generation}) stopped.",
                    host=task.hostname,
                )
            return {**tasks, task.hostname: task}

        await asyncio.to_thread(self.file.update, change)

    async def list_tasks(self) -> list[ProvisioningTask]:
        tasks = await asyncio.to_thread(self.file.read)
        return [tasks[k] for k in sorted(tasks)]

    def _take(self, host: str, operation_id: str) -> tuple[int, int] | dict[str, Any]:
        """(fd, generation) with the flock held, or the holder's record when another holds it."""
        try:
            self.lease_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._lease_path(host), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RegistryUnavailable(
                f"The lease directory {self.lease_dir} cannot be used ({exc.strerror}); set QIIP_STATE_DIR to a "
                "writable directory."
            ) from exc
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(fd)
            last = _read_holder(fd).get("generation", 0)
            recorded = self.file.read().get(host)
            generation = max(int(last) if isinstance(last, int) else 0, (recorded.generation or 0) if recorded else 0)
            generation += 1
            holder = {
                "owner": self.owner,
                "instance": self.instance,
                "operation_id": operation_id,
                "generation": generation,
                "pid": os.getpid(),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd, generation

    async def acquire(self, host: str, operation_id: str) -> HostLease:
        taken = await asyncio.to_thread(self._take, host, operation_id)
        if isinstance(taken, dict):
            raise HostBusy(
                f"Host {host} is busy: operation {taken.get('operation_id', '?')} of gateway "
                f"{taken.get('owner', '?')} holds its lease; wait for it to finish.",
                host=host,
            )
        fd, generation = taken
        return _EmbeddedLease(host, operation_id, generation, fd)

    def _held(self, host: str) -> bool:
        """Whether some process holds `host`'s flock now (tried without taking it for long)."""
        try:
            fd = os.open(self._lease_path(host), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    async def stale(self) -> list[tuple[ProvisioningTask, str]]:
        def find() -> list[tuple[ProvisioningTask, str]]:
            found = []
            for task in self.file.read().values():
                if task.state is TaskState.RUNNING and not self._held(task.hostname):
                    why = "this gateway restarted" if task.owner == self.owner else "its gateway stopped"
                    found.append((task, why))
            return found

        return await asyncio.to_thread(find)


def _newer(current: ProvisioningTask | None, task: ProvisioningTask) -> bool:
    """True when `current` was written under a newer lease than `task` (a fenced write must be refused)."""
    if current is None or task.generation is None or current.generation is None:
        return False
    return current.generation > task.generation


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# -- etcd ----------------------------------------------------------------------------------------------------


class _EtcdLease(HostLease):
    def __init__(self, store: EtcdTaskStore, host: str, operation_id: str, lease_id: int, generation: int) -> None:
        self.store = store
        self.host = host
        self.operation_id = operation_id
        self.lease_id = lease_id
        self.generation = generation
        self.confirmed_at = time.monotonic()
        self._refresh = asyncio.create_task(self._keep_alive(), name=f"qiip-host-lease-{host}")
        self._released = False

    async def _keep_alive(self) -> None:
        interval = self.store.ttl_s / 3
        while not self.lost:
            await asyncio.sleep(interval)
            try:
                ttl = await asyncio.to_thread(self.store.client.refresh, self.lease_id)
            except RegistryUnavailable as exc:
                logger.warning("could not refresh the lease of host %s: %s", self.host, exc.message)
                if time.monotonic() - self.confirmed_at > self.store.ttl_s:
                    self._mark_lost(f"etcd did not confirm it for {self.store.ttl_s} s")
                continue
            if ttl <= 0:
                self._mark_lost("its etcd lease expired")
            else:
                self.confirmed_at = time.monotonic()

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

    def _key(self, host: str) -> bytes:
        return self.prefix + host.encode()

    def _lease_key(self, host: str) -> bytes:
        return self.lease_prefix + host.encode()

    def _put(self, task: ProvisioningTask) -> bool:
        value = json.dumps(task.model_dump(mode="json"), separators=(",", ":")).encode()
        if task.generation is None:
            self.client.put(self._key(task.hostname), value)
            return True
        # Fenced: written only while the lease key is still the one created at `generation`.
        txn = {
            "compare": [
                {
                    "key": b64(self._lease_key(task.hostname)),
                    "result": "EQUAL",
                    "target": "CREATE",
                    "create_revision": task.generation,
                }
            ],
            "success": [{"request_put": {"key": b64(self._key(task.hostname)), "value": b64(value)}}],
            "failure": [],
        }
        result = self.client.call(lambda c: c.transaction(txn))
        return bool(result.get("succeeded"))

    async def put(self, task: ProvisioningTask) -> None:
        if not await asyncio.to_thread(self._put, task):
            raise LeaseLost(
                f"The lease of host {task.hostname} (generation {task.generation}) is gone or another operation "
                "holds the host now; this operation stopped without writing its record.",
                host=task.hostname,
            )

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
        body = {"key": b64(self._lease_key(host))}
        result = self.client.call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        kvs = result.get("kvs") or []
        if not kvs:
            return None
        try:
            holder: dict[str, Any] = json.loads(unb64(kvs[0].get("value", "")))
        except ValueError:
            holder = {}
        holder["lease"] = int(kvs[0].get("lease", 0) or 0)
        holder["generation"] = int(kvs[0].get("create_revision", 0) or 0)
        return holder

    def _take(self, host: str, operation_id: str) -> tuple[int, int] | None:
        key = self._lease_key(host)
        value = json.dumps({"owner": self.owner, "instance": self.instance, "operation_id": operation_id}).encode()

        def txn(client: Any) -> tuple[int, int] | None:
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
            # The transaction's revision is the lease key's creation revision: the fencing generation.
            return int(lease.id), int(result["header"]["revision"])

        taken: tuple[int, int] | None = self.client.call(txn)
        return taken

    def revoke(self, lease_id: int) -> None:
        """Revoke an etcd lease (its lease key goes with it)."""
        self.client.call(lambda c: etcd_lease.Lease(lease_id, c).revoke())

    def _mine_from_before(self, holder: dict[str, Any]) -> bool:
        """True for a lease this gateway took before it restarted (its owner name, another instance)."""
        return holder.get("owner") == self.owner and holder.get("instance") != self.instance

    async def acquire(self, host: str, operation_id: str) -> HostLease:
        for _ in range(2):
            taken = await asyncio.to_thread(self._take, host, operation_id)
            if taken is not None:
                return _EtcdLease(self, host, operation_id, *taken)
            holder = await asyncio.to_thread(self._holder, host) or {}
            if not (holder and self._mine_from_before(holder) and holder.get("lease")):
                break
            # This gateway's own lease from before a restart: nothing of it runs any more.
            await asyncio.to_thread(self.revoke, holder["lease"])
        raise HostBusy(
            f"Host {host} is busy: operation {holder.get('operation_id', '?')} of gateway "
            f"{holder.get('owner', '?')} holds its lease; wait for it to finish.",
            host=host,
        )

    async def stale(self) -> list[tuple[ProvisioningTask, str]]:
        found = []
        for task in await self.list_tasks():
            if task.state is not TaskState.RUNNING:
                continue
            holder = await asyncio.to_thread(self._holder, task.hostname)
            if holder is None:
                found.append((task, "its host lease expired"))
            elif self._mine_from_before(holder):
                found.append((task, "this gateway restarted"))
        return found

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.close)


def create_task_store(settings: Settings, owner: str) -> TaskStore:
    """The task store of `registry.backend`: the state directory's file, or etcd.

    Args:
        settings: the daemon's settings.
        owner: this gateway's name in records and leases.
    """
    if settings.registry.backend == "etcd":
        return EtcdTaskStore(settings, owner)
    return EmbeddedTaskStore(settings, owner)

"""Where deployments, their statuses and the pool's added hosts live: the registry's backend.

```
DeploymentStore                       one interface, two backends (`registry.backend`)
├── EmbeddedDeploymentStore           <state_dir>/deployments.json, deployment-status.json, hosts.json
│                                     (`LockedJsonFile`s: flock around read-modify-write, atomic rewrite)
└── EtcdDeploymentStore               <etcd.deployments_prefix>spec/<name>, status/<name>, hosts/<name>;
                                      a write of a spec is a transaction on the key's mod revision
```

A spec is written only against the generation the writer read (`replace(…, expected_generation=)`): two
operators applying at once, one wins and the other gets 409 with both generations. Statuses are written by the
one active controller (its leadership is the fence, `qiip_core.deployments.Leadership`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from qiip_core._errors import DeploymentConflict, DeploymentError, DeploymentNotFound, HostNotInPool, HostPoolError
from qiip_core.deployments._hosts import HostSpec
from qiip_core.deployments._resource import Deployment, DeploymentStatus
from qiip_core.storage import EtcdClient, LockedJsonFile, b64, load_json_object, unb64

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = [
    "DeploymentStore",
    "EmbeddedDeploymentStore",
    "EtcdDeploymentStore",
    "create_deployment_store",
]

logger = logging.getLogger("qiip.deployments")

_M = TypeVar("_M", bound=BaseModel)


class _DeploymentFile(LockedJsonFile[Deployment]):
    file_name = "deployments.json"
    items_key = "deployments"
    model = Deployment
    noun = "deployment file"
    fresh_start = "start with no deployments"
    entry_noun = "deployment"
    error = DeploymentError
    log = logger


class _StatusFile(LockedJsonFile[DeploymentStatus]):
    file_name = "deployment-status.json"
    items_key = "statuses"
    model = DeploymentStatus
    noun = "deployment status file"
    fresh_start = "start with empty statuses (the controller rebuilds them)"
    entry_noun = "status"
    error = DeploymentError
    log = logger


class _HostFile(LockedJsonFile[HostSpec]):
    file_name = "hosts.json"
    items_key = "hosts"
    model = HostSpec
    noun = "host pool file"
    fresh_start = "start with no added hosts"
    entry_noun = "host"
    error = HostPoolError
    log = logger


def _check_generation(current: Deployment | None, name: str, expected: int | None) -> None:
    if expected is None:
        return
    if expected == 0:
        if current is not None:
            raise DeploymentConflict(
                f"Deployment {name!r} exists already (generation {current.generation}); replace it with its generation."
            )
        return
    if current is None:
        raise DeploymentNotFound(name)
    if current.generation != expected:
        raise DeploymentConflict(
            f"Deployment {name!r} is at generation {current.generation}, not {expected}: it changed since it was "
            "read. Read it again and re-apply."
        )


class DeploymentStore(ABC):
    """Deployments, their statuses and the pool's added hosts.

    Every method may raise `DeploymentError` (or `HostPoolError` for hosts) when the backend cannot be used.
    """

    @abstractmethod
    async def deployments(self) -> list[Deployment]:
        """Every deployment, by name."""

    async def get(self, name: str) -> Deployment:
        """The deployment named `name`.

        Raises:
            DeploymentNotFound: there is none.
        """
        found = next((d for d in await self.deployments() if d.name == name), None)
        if found is None:
            raise DeploymentNotFound(name)
        return found

    @abstractmethod
    async def write(self, deployment: Deployment, *, expected_generation: int | None) -> Deployment:
        """Store `deployment` if the stored one is at `expected_generation`.

        Args:
            deployment: the record to store.
            expected_generation: 0: it must not exist yet; N: the stored one must be at generation N; None: no
                precondition (the controller's own writes).

        Returns:
            The record stored.

        Raises:
            DeploymentConflict: the precondition failed.
            DeploymentNotFound: a generation was expected but there is no such deployment.
        """

    @abstractmethod
    async def remove(self, name: str) -> None:
        """Delete the deployment and its status (the controller, once no replica is left)."""

    @abstractmethod
    async def statuses(self) -> dict[str, DeploymentStatus]:
        """Every stored status, by deployment."""

    async def status(self, name: str) -> DeploymentStatus | None:
        """The stored status of `name`, if any."""
        return (await self.statuses()).get(name)

    @abstractmethod
    async def put_status(self, status: DeploymentStatus) -> None:
        """Store a status (the active controller)."""

    @abstractmethod
    async def hosts(self) -> list[HostSpec]:
        """The hosts added to the pool (`qiip host add`), by name."""

    @abstractmethod
    async def add_host(self, host: HostSpec) -> HostSpec:
        """Add (or replace) a host of the pool."""

    @abstractmethod
    async def remove_host(self, name: str) -> None:
        """Remove an added host.

        Raises:
            HostNotInPool: no added host has this name.
        """

    async def aclose(self) -> None:
        """Release the backend's connections."""
        return None


class EmbeddedDeploymentStore(DeploymentStore):
    """The state directory's files (one daemon per state directory, plus the CLI)."""

    def __init__(self, settings: Settings) -> None:
        self.spec_file = _DeploymentFile(settings.state_dir)
        self.status_file = _StatusFile(settings.state_dir)
        self.host_file = _HostFile(settings.state_dir)

    async def deployments(self) -> list[Deployment]:
        items = await asyncio.to_thread(self.spec_file.read)
        return [items[k] for k in sorted(items)]

    async def write(self, deployment: Deployment, *, expected_generation: int | None) -> Deployment:
        def change(items: dict[str, Deployment]) -> dict[str, Deployment]:
            _check_generation(items.get(deployment.name), deployment.name, expected_generation)
            return {**items, deployment.name: deployment}

        await asyncio.to_thread(self.spec_file.update, change)
        return deployment

    async def remove(self, name: str) -> None:
        await asyncio.to_thread(self.spec_file.update, lambda items: {k: v for k, v in items.items() if k != name})
        await asyncio.to_thread(self.status_file.update, lambda items: {k: v for k, v in items.items() if k != name})

    async def statuses(self) -> dict[str, DeploymentStatus]:
        return await asyncio.to_thread(self.status_file.read)

    async def put_status(self, status: DeploymentStatus) -> None:
        await asyncio.to_thread(self.status_file.update, lambda items: {**items, status.name: status})

    async def hosts(self) -> list[HostSpec]:
        items = await asyncio.to_thread(self.host_file.read)
        return [items[k] for k in sorted(items)]

    async def add_host(self, host: HostSpec) -> HostSpec:
        await asyncio.to_thread(self.host_file.update, lambda items: {**items, host.name: host})
        return host

    async def remove_host(self, name: str) -> None:
        def change(items: dict[str, HostSpec]) -> dict[str, HostSpec]:
            if name not in items:
                raise HostNotInPool(name)
            return {k: v for k, v in items.items() if k != name}

        await asyncio.to_thread(self.host_file.update, change)


class EtcdDeploymentStore(DeploymentStore):
    """Keys under `etcd.deployments_prefix`, shared by every gateway of the fleet."""

    def __init__(self, settings: Settings) -> None:
        self.client = EtcdClient(settings.etcd)
        prefix = settings.etcd.deployments_prefix.encode()
        self.spec_prefix = prefix + b"spec/"
        self.status_prefix = prefix + b"status/"
        self.host_prefix = prefix + b"hosts/"
        self.max_value_bytes = settings.etcd.max_value_bytes

    def _read(self, prefix: bytes, model: type[_M]) -> list[tuple[_M, int]]:
        _, kvs = self.client.range_prefix(prefix)
        found: list[tuple[_M, int]] = []
        for kv in kvs:
            key = unb64(kv["key"]).decode(errors="replace")
            try:
                data = load_json_object(unb64(kv.get("value", "")), max_value_bytes=self.max_value_bytes)
                found.append((model.model_validate(data), int(kv.get("mod_revision", 0))))
            except (ValueError, ValidationError) as exc:
                logger.warning("skipping the record %s: %s", key.encode("unicode_escape").decode(), exc)
        return found

    @staticmethod
    def _dump(record: BaseModel) -> bytes:
        return json.dumps(record.model_dump(mode="json"), separators=(",", ":")).encode()

    async def _call(self, fn: Callable[[], Any], error: type[Exception] = DeploymentError) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except DeploymentError:
            raise
        except HostPoolError:
            raise
        except Exception as exc:  # RegistryUnavailable: the backend is down
            message = getattr(exc, "message", str(exc))
            raise error(f"The deployment store in etcd cannot be used: {message}") from exc

    async def deployments(self) -> list[Deployment]:
        found = await self._call(lambda: self._read(self.spec_prefix, Deployment))
        return sorted((d for d, _ in found), key=lambda d: d.name)

    def _write(self, deployment: Deployment, expected: int | None) -> None:
        key = self.spec_prefix + deployment.name.encode()
        current = next(((d, rev) for d, rev in self._read(key, Deployment) if d.name == deployment.name), (None, 0))
        _check_generation(current[0], deployment.name, expected)
        compare = [{"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": current[1]}]
        success = [{"request_put": {"key": b64(key), "value": b64(self._dump(deployment))}}]
        result = self.client.call(lambda c: c.transaction({"compare": compare, "success": success, "failure": []}))
        if not result.get("succeeded"):
            raise DeploymentConflict(
                f"Deployment {deployment.name!r} changed while it was written; read it again and re-apply."
            )

    async def write(self, deployment: Deployment, *, expected_generation: int | None) -> Deployment:
        await self._call(lambda: self._write(deployment, expected_generation))
        return deployment

    async def remove(self, name: str) -> None:
        await self._call(lambda: self.client.delete(self.spec_prefix + name.encode()))
        await self._call(lambda: self.client.delete(self.status_prefix + name.encode()))

    async def statuses(self) -> dict[str, DeploymentStatus]:
        found = await self._call(lambda: self._read(self.status_prefix, DeploymentStatus))
        return {s.name: s for s, _ in found}

    async def put_status(self, status: DeploymentStatus) -> None:
        await self._call(lambda: self.client.put(self.status_prefix + status.name.encode(), self._dump(status)))

    async def hosts(self) -> list[HostSpec]:
        found = await self._call(lambda: self._read(self.host_prefix, HostSpec), HostPoolError)
        return sorted((h for h, _ in found), key=lambda h: h.name)

    async def add_host(self, host: HostSpec) -> HostSpec:
        await self._call(
            lambda: self.client.put(self.host_prefix + host.name.encode(), self._dump(host)), HostPoolError
        )
        return host

    async def remove_host(self, name: str) -> None:
        existed = await self._call(lambda: self.client.delete(self.host_prefix + name.encode()), HostPoolError)
        if not existed:
            raise HostNotInPool(name)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.client.close)


def create_deployment_store(settings: Settings) -> DeploymentStore:
    """The deployment store of `registry.backend`: the state directory's files, or etcd.

    Args:
        settings: the daemon's (or the CLI's) settings.
    """
    if settings.registry.backend == "etcd":
        return EtcdDeploymentStore(settings)
    return EmbeddedDeploymentStore(settings)

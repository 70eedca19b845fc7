"""One active deployment controller per fleet: a leader lease, with a fencing token.

```
Leadership.campaign() -> bool       take or keep the lease; True while this process leads
Leadership.token                    grows with every new term (etcd: the leader key's create revision)
├── FileLeadership                  embedded registry: an exclusive flock on <state_dir>/deployments.leader
│                                   (the kernel frees it when the process dies, however it dies)
└── EtcdLeadership                  etcd: <deployments_prefix>leader, created only if absent under an etcd lease of
                                    `deployments.leader_ttl_s`, refreshed on every campaign; a dead leader's key
                                    lapses with its lease and the next gateway to campaign takes over
```

A leader checks `campaign()` before each pass and stops acting when it returns False; the host operations it
starts are fenced again by their host leases (`qiip_core.provisioning`), so a leader that lost its lease without
noticing yet cannot run a second operation on a host.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiip_core._errors import RegistryUnavailable
from qiip_core.storage import EtcdClient, b64, unb64

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["EtcdLeadership", "FileLeadership", "Leadership", "create_leadership"]

logger = logging.getLogger("qiip.deployments")


class Leadership(ABC):
    """The lease that makes one controller active.

    Args:
        owner: this gateway's name (`<host name>:<port>`).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.token = 0
        """The fencing token of the current term; 0 while not leading."""
        self.leader: str | None = None
        """The gateway that leads, as last seen (this one's `owner` while leading)."""

    @abstractmethod
    async def campaign(self) -> bool:
        """Take the lease if it is free, keep it if held. Returns whether this process leads now; never raises
        (a backend that cannot be reached means not leading)."""

    @abstractmethod
    async def resign(self) -> None:
        """Give the lease up (on shutdown), so another gateway takes over at once."""


class FileLeadership(Leadership):
    """The embedded registry's lease: an exclusive `flock` on `<state_dir>/deployments.leader`."""

    def __init__(self, state_dir: Path, owner: str) -> None:
        super().__init__(owner)
        self.path = state_dir / "deployments.leader"
        self._fd: int | None = None

    def _try(self) -> bool:
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            with contextlib.suppress(OSError):
                self.leader = os.pread(fd, 4096, 0).decode(errors="replace").split("\n")[0] or None
            os.close(fd)
            return False
        raw = os.pread(fd, 4096, 0).decode(errors="replace").split("\n")
        term = int(raw[1]) if len(raw) > 1 and raw[1].isdigit() else 0
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.owner}\n{term + 1}\n".encode(), 0)
        self._fd = fd
        self.token = term + 1
        self.leader = self.owner
        return True

    async def campaign(self) -> bool:
        try:
            return await asyncio.to_thread(self._try)
        except OSError as exc:
            logger.warning("the deployment controller's lock %s cannot be used: %s", self.path, exc.strerror)
            return False

    async def resign(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.token = 0


class EtcdLeadership(Leadership):
    """The etcd lease: `<etcd.deployments_prefix>leader`, created only if absent, under an etcd lease."""

    def __init__(self, settings: Settings, owner: str) -> None:
        super().__init__(owner)
        self.client = EtcdClient(settings.etcd)
        self.key = settings.etcd.deployments_prefix.encode() + b"leader"
        self.ttl_s = settings.deployments.leader_ttl_s
        self._lease_id = 0
        self._refreshed = 0.0
        # A campaign runs in a thread that a shutdown's cancellation does not stop: resigning waits for it, and no
        # campaign runs after, so a resigned gateway never takes the lease again behind its own back.
        self._lock = threading.Lock()
        self._resigned = False

    def _holder(self) -> dict[str, Any] | None:
        result = self.client.call(lambda c: c.post(c.get_url("/kv/range"), json={"key": b64(self.key)}))
        kvs = result.get("kvs") or []
        if not kvs:
            return None
        try:
            holder: dict[str, Any] = json.loads(unb64(kvs[0].get("value", "")))
        except ValueError:
            holder = {}
        holder["lease"] = int(kvs[0].get("lease", 0) or 0)
        holder["create_revision"] = int(kvs[0].get("create_revision", 0) or 0)
        return holder

    def _campaign(self) -> bool:
        with self._lock:
            return False if self._resigned else self._campaign_locked()

    def _campaign_locked(self) -> bool:
        if self._lease_id:
            ttl = self.client.refresh(self._lease_id)
            holder = self._holder()
            if ttl > 0 and holder is not None and holder.get("lease") == self._lease_id:
                self._refreshed = time.monotonic()
                return True
            logger.warning("the deployment controller's lease lapsed; this gateway stops acting")
            self._lease_id = 0
            self.token = 0
        value = json.dumps({"owner": self.owner}).encode()

        def txn(client: Any) -> int:
            lease = client.lease(ttl=self.ttl_s)
            result = client.transaction(
                {
                    "compare": [{"key": b64(self.key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                    "success": [{"request_put": {"key": b64(self.key), "value": b64(value), "lease": lease.id}}],
                    "failure": [],
                }
            )
            if not result.get("succeeded"):
                lease.revoke()
                return 0
            return int(lease.id)

        self._lease_id = self.client.call(txn)
        holder = self._holder()
        if not self._lease_id or holder is None or holder.get("lease") != self._lease_id:
            self._lease_id = 0
            self.token = 0
            self.leader = holder.get("owner") if holder else None
            return False
        self.token = int(holder["create_revision"])
        self.leader = self.owner
        self._refreshed = time.monotonic()
        logger.info("this gateway leads the deployment controller (term %d)", self.token)
        return True

    async def campaign(self) -> bool:
        try:
            return await asyncio.to_thread(self._campaign)
        except RegistryUnavailable as exc:
            # Past the TTL since the last refresh the lease is surely gone; until then another gateway cannot
            # have it either, but acting on an etcd this gateway cannot read would be blind: stop acting.
            logger.warning("the deployment controller cannot reach etcd: %s", exc.message)
            self.token = 0
            self._lease_id = 0
            return False

    def _resign(self) -> None:
        with self._lock:
            self._resigned = True
            lease_id, self._lease_id, self.token = self._lease_id, 0, 0
            if lease_id:
                with contextlib.suppress(RegistryUnavailable):
                    self.client.call(lambda c: c.post(c.get_url("/lease/revoke"), json={"ID": lease_id}))
            self.client.close()

    async def resign(self) -> None:
        await asyncio.to_thread(self._resign)


def create_leadership(settings: Settings, owner: str) -> Leadership:
    """The leader lease of `registry.backend`.

    Args:
        settings: the daemon's settings.
        owner: this gateway's name.
    """
    if settings.registry.backend == "etcd":
        return EtcdLeadership(settings, owner)
    return FileLeadership(settings.state_dir, owner)

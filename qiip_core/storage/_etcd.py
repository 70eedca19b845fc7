"""Synchronous access to etcd: `EtcdClient`, with failover between endpoints and etcd authentication.

Key/value, lease and transaction calls use `etcd3gw` over etcd's v3 JSON gateway (synchronous; callers run them
off the event loop with `asyncio.to_thread`). Keys and values cross that gateway as base64 (`b64`, `unb64`), and a
prefix is read as the range from the prefix to `prefix_range_end(prefix)`.

The etcd registry (`qiip_core.discovery`) and the etcd token store (`qiip_core.auth`) each own a client, and
follow their prefix with a `PrefixFollower` (`_follow`) built on it.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import etcd3gw
import requests
from etcd3gw.lease import Lease

from qiip_core._errors import RegistryUnavailable
from qiip_core.config import EtcdSettings

__all__ = ["EtcdClient", "b64", "prefix_range_end", "unb64"]


def b64(data: bytes) -> str:
    """`data` as etcd's JSON gateway carries keys and values: base64 text."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    """The bytes of a key or value etcd's JSON gateway gave as base64 text."""
    return base64.b64decode(text)


def prefix_range_end(prefix: bytes) -> bytes:
    """The end of etcd's range for every key starting with `prefix` (the prefix with its last byte + 1)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdClient:
    """Synchronous access to etcd through `etcd3gw`, with failover between endpoints and etcd auth.

    Every method blocks: call it with `asyncio.to_thread`. Every failure is a `RegistryUnavailable`.

    Args:
        settings: endpoints, timeouts, TLS and credentials.
    """

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._index = 0
        self._clients: dict[int, Any] = {}
        self._token: str | None = None

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        return self.settings.endpoints[self._index]

    def _client(self) -> Any:
        client = self._clients.get(self._index)
        if client is None:
            parts = urlsplit(self.endpoint)
            session = requests.Session()
            session.trust_env = False
            client = etcd3gw.client(
                host=parts.hostname or "127.0.0.1",
                port=parts.port or 2379,
                protocol=parts.scheme,
                ca_cert=str(self.settings.ca_file) if self.settings.ca_file else None,
                cert_key=str(self.settings.key_file) if self.settings.key_file else None,
                cert_cert=str(self.settings.cert_file) if self.settings.cert_file else None,
                timeout=self.settings.timeout_s,
                session=session,
            )
            self._clients[self._index] = client
        if self.settings.username and self._token is None:
            self._authenticate(client)
        return client

    def _authenticate(self, client: Any) -> None:
        assert self.settings.password is not None
        body = {"name": self.settings.username, "password": self.settings.password.get_secret_value()}
        response = client.session.post(client.get_url("/auth/authenticate"), json=body, timeout=client.timeout)
        if response.status_code != 200:
            raise RegistryUnavailable(
                f"etcd at {self.endpoint} refused the credentials of user {self.settings.username!r} "
                f"(HTTP {response.status_code}); check etcd.username and etcd.password."
            )
        self._token = response.json()["token"]
        client.session.headers["Authorization"] = self._token

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers the watch stream needs (the auth token, when etcd authentication is on)."""
        return {"Authorization": self._token} if self._token else {}

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(client)`, trying each endpoint once, re-authenticating once on an expired token.

        Raises:
            RegistryUnavailable: no endpoint answered, or etcd refused the request.
        """
        last: Exception | None = None
        for _ in range(len(self.settings.endpoints)):
            try:
                return fn(self._client())
            except RegistryUnavailable:
                raise
            except etcd3gw.exceptions.Etcd3Exception as exc:
                last = exc
                if self._token is not None and "token" in str(exc).lower():
                    self._token = None
                    with contextlib.suppress(Exception):
                        return fn(self._client())
                if not isinstance(
                    exc, etcd3gw.exceptions.ConnectionFailedError | etcd3gw.exceptions.ConnectionTimeoutError
                ):
                    raise RegistryUnavailable(f"etcd at {self.endpoint} refused the request: {exc}") from exc
            except (requests.RequestException, OSError) as exc:
                last = exc
            self._index = (self._index + 1) % len(self.settings.endpoints)
            self._token = None
        raise RegistryUnavailable(
            f"etcd is unreachable at {', '.join(self.settings.endpoints)} ({type(last).__name__}: {last})."
        )

    def range_prefix(self, prefix: bytes) -> tuple[int, list[dict[str, Any]]]:
        """(store revision, raw kvs) of every key under `prefix`."""
        body = {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}
        result = self.call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        return int(result["header"]["revision"]), list(result.get("kvs", []))

    def put(self, key: bytes, value: bytes, *, lease_ttl_s: int | None = None) -> int:
        """Write a key, with a new lease of `lease_ttl_s` when given. Returns the lease id (0: none)."""

        def write(client: Any) -> int:
            lease = client.lease(ttl=lease_ttl_s) if lease_ttl_s else None
            client.put(key, value, lease=lease)
            return int(lease.id) if lease is not None else 0

        result: int = self.call(write)
        return result

    def put_with_lease(self, key: bytes, value: bytes, lease_id: int) -> None:
        """Rewrite a key keeping its lease (0: no lease)."""
        self.call(lambda c: c.put(key, value, lease=Lease(lease_id, c) if lease_id else None))

    def delete(self, key: bytes) -> bool:
        """Delete a key. Returns False when it did not exist."""
        result: bool = self.call(lambda c: c.delete(key))
        return result

    def refresh(self, lease_id: int) -> int:
        """Refresh a lease. Returns its new TTL in seconds (0 or less: the lease is gone)."""
        result: int = self.call(lambda c: Lease(lease_id, c).refresh())
        return result

    def adopt(self, key: bytes, value: bytes, *, mod_revision: int, lease_ttl_s: int) -> bool:
        """Re-write an unleased key with a fresh lease, only if it is still at `mod_revision` without a lease.

        Returns:
            True when the transaction succeeded.
        """

        def txn(client: Any) -> bool:
            lease = client.lease(ttl=lease_ttl_s)
            compare = [
                {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision},
                {"key": b64(key), "result": "EQUAL", "target": "LEASE", "lease": 0},
            ]
            success = [{"request_put": {"key": b64(key), "value": b64(value), "lease": lease.id}}]
            result = client.transaction({"compare": compare, "success": success, "failure": []})
            if not result.get("succeeded"):
                lease.revoke()
            return bool(result.get("succeeded"))

        result: bool = self.call(txn)
        return result

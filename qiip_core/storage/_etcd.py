"""Synchronous access to etcd: `EtcdClient`, with failover between endpoints and etcd authentication.

Key/value, lease and transaction calls use `etcd3gw` over etcd's v3 JSON gateway (synchronous; callers run them
off the event loop with `asyncio.to_thread`). Keys and values cross that gateway as base64 (`b64`, `unb64`), and a
prefix is read as the range from the prefix to `prefix_range_end(prefix)`.

The etcd registry (`qiip_core.discovery`) and the etcd token store (`qiip_core.auth`) each own a client, and
follow their prefix with a `PrefixFollower` (`_follow`) built on it.

etcd3gw's, requests' and the OS's exceptions are translated here, in one table (`_etcd_errors`, the most specific
class winning), and never leave `EtcdClient.call`: an endpoint that does not answer sends the call to the next
one, a refusal is a `RegistryUnavailable`, and an auth token etcd rejects is renewed once. etcd3gw has no class
for that rejection (an HTTP 401 is a bare `Etcd3Exception` whose text is the reason, `Unauthorized`); its type is
the gRPC status code in etcd's JSON body, 16 (UNAUTHENTICATED).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from qiip_core._errors import RegistryUnavailable
from qiip_core._lazy import LazyModule
from qiip_core.config import EtcdSettings

if TYPE_CHECKING:
    import etcd3gw
    import requests
    from etcd3gw import lease as etcd_lease
else:
    # A daemon on the embedded registry never loads etcd3gw (and requests under it).
    etcd3gw = LazyModule("etcd3gw")
    etcd_lease = LazyModule("etcd3gw.lease")
    requests = LazyModule("requests")

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


_UNAUTHENTICATED = 16
"""gRPC's UNAUTHENTICATED, in the body of etcd's HTTP 401: `etcdserver: invalid auth token` (expired or invalidated)."""


class _Unreachable(RegistryUnavailable):
    """The endpoint did not answer (refused, reset or timed out): `EtcdClient.call` tries the next one."""


class _TokenRejected(RegistryUnavailable):
    """etcd rejected the auth token (gRPC UNAUTHENTICATED): `EtcdClient.call` authenticates again, once."""


@functools.cache
def _etcd_errors() -> dict[type[Exception], type[RegistryUnavailable]]:
    """Library exception → ours. The most specific class in the exception's MRO wins."""
    return {
        etcd3gw.exceptions.ConnectionFailedError: _Unreachable,  # connection refused or reset; HTTP 503
        etcd3gw.exceptions.ConnectionTimeoutError: _Unreachable,  # no answer in `timeout_s`; HTTP 408 or 504
        etcd3gw.exceptions.InternalServerError: RegistryUnavailable,  # HTTP 500
        etcd3gw.exceptions.PreconditionFailedError: RegistryUnavailable,  # HTTP 412
        etcd3gw.exceptions.ApiVersionDiscoveryFailedError: RegistryUnavailable,  # `/version` answered nonsense
        etcd3gw.exceptions.WatchTimedOut: RegistryUnavailable,  # etcd3gw's own watch, which QIIP does not use
        etcd3gw.exceptions.Etcd3Exception: RegistryUnavailable,  # any other refusal; a 401 is `_TokenRejected`
        requests.RequestException: _Unreachable,  # the authenticate request, which QIIP sends itself
        OSError: _Unreachable,  # the TLS files, or a socket error below requests
    }


def _grpc_status(exc: Exception) -> tuple[int | None, str]:
    """(gRPC status code, message) of the JSON body etcd answered an error with (etcd3gw's `detail_text`)."""
    try:
        body = json.loads(getattr(exc, "detail_text", None) or "")
    except ValueError:
        return None, str(exc)
    if not isinstance(body, dict):
        return None, str(exc)
    code = body.get("code")
    return (code if isinstance(code, int) else None), str(body.get("message") or exc)


def _describe(exc: BaseException | None) -> str:
    """What went wrong, in words: etcd3gw's connection errors keep their text in `detail_text`, not in `args`."""
    return str(exc) or str(getattr(exc, "detail_text", None) or "")


def _translate(exc: Exception, endpoint: str) -> RegistryUnavailable:
    """Our error for a library exception of `_etcd_errors`, naming the endpoint (the caller chains `exc`)."""
    errors = _etcd_errors()
    ours = next(errors[kind] for kind in type(exc).__mro__ if kind in errors)
    if ours is _Unreachable:
        return _Unreachable(f"etcd at {endpoint} did not answer ({type(exc).__name__}: {_describe(exc)}).")
    # etcd3gw has no class for HTTP 401: the error's type is the gRPC status code etcd puts in the body.
    code, message = _grpc_status(exc)
    if code == _UNAUTHENTICATED:
        return _TokenRejected(f"etcd at {endpoint} rejected the auth token ({message}).")
    return ours(f"etcd at {endpoint} refused the request: {exc}")


@contextlib.contextmanager
def _translated(endpoint: str) -> Iterator[None]:
    """Raise the library exceptions of `_etcd_errors` as ours, `from` the original; ours pass through."""
    try:
        yield
    except RegistryUnavailable:
        raise
    except tuple(_etcd_errors()) as exc:
        raise _translate(exc, endpoint) from exc


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
        # etcd answers 401 to an authenticate request that carries a stale token: send none.
        client.session.headers.pop("Authorization", None)
        response = client.session.post(client.get_url("/auth/authenticate"), json=body, timeout=client.timeout)
        if response.status_code != 200:
            raise RegistryUnavailable(
                f"etcd at {self.endpoint} refused the credentials of user {self.settings.username!r} "
                f"(HTTP {response.status_code}); check etcd.username and etcd.password."
            )
        self._token = response.json()["token"]
        client.session.headers["Authorization"] = self._token

    def close(self) -> None:
        """Close the HTTP session of every endpoint used (and its connections); a later call opens new ones."""
        for client in self._clients.values():
            client.session.close()
        self._clients.clear()
        self._token = None

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers the watch stream needs (the auth token, when etcd authentication is on)."""
        return {"Authorization": self._token} if self._token else {}

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(client)`, trying each endpoint once, and authenticating again once if etcd rejects the token.

        etcd's simple auth tokens lapse (`--auth-token-ttl`, 300 s idle by default) and are invalidated when
        authentication is switched off and on; the retry gets a fresh one. A failure of the retry is handled like
        any other failure, with its own cause: an endpoint that does not answer moves on to the next one, a
        refusal is raised.

        Args:
            fn: the call, given the endpoint's `etcd3gw` client; it may raise any `etcd3gw`, `requests` or OS
                error, which is translated (`_etcd_errors`).

        Returns:
            What `fn` returns.

        Raises:
            RegistryUnavailable: no endpoint answered, etcd refused the request, or it rejected the token again
                after authenticating anew; chained to the library's exception.
        """
        last: _Unreachable | None = None
        reauthenticated = False
        tried = 0
        while tried < len(self.settings.endpoints):
            try:
                with _translated(self.endpoint):
                    return fn(self._client())
            except _TokenRejected as exc:
                if self._token is None or reauthenticated:
                    raise RegistryUnavailable(exc.message) from exc.__cause__
                reauthenticated = True
                self._token = None  # the next `_client()` authenticates; the same endpoint is tried again
                continue
            except _Unreachable as exc:
                last = exc
            self._index = (self._index + 1) % len(self.settings.endpoints)
            self._token = None
            tried += 1
        cause = last.__cause__ if last is not None else None
        raise RegistryUnavailable(
            f"etcd is unreachable at {', '.join(self.settings.endpoints)} ({type(cause).__name__}: {_describe(cause)})."
        ) from cause

    def range_prefix(self, prefix: bytes, *, revision: int | None = None) -> tuple[int, list[dict[str, Any]]]:
        """(store revision, raw kvs) of every key under `prefix`, as of `revision` when given (etcd's range
        `revision`: several prefixes read at one revision are one moment's state).

        Raises:
            RegistryUnavailable: etcd cannot be read, or `revision` was compacted away.
        """
        body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}
        if revision is not None:
            body["revision"] = revision
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
        self.call(lambda c: c.put(key, value, lease=etcd_lease.Lease(lease_id, c) if lease_id else None))

    def delete(self, key: bytes) -> bool:
        """Delete a key. Returns False when it did not exist."""
        result: bool = self.call(lambda c: c.delete(key))
        return result

    def refresh(self, lease_id: int) -> int:
        """Refresh a lease. Returns its new TTL in seconds (0 or less: the lease is gone)."""
        result: int = self.call(lambda c: etcd_lease.Lease(lease_id, c).refresh())
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

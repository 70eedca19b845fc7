"""Where `qiip agent` puts its readings: an etcd key under a lease, or a small authenticated HTTP endpoint.

```
Publisher            start() · publish(reading) · withdraw(reason) · aclose()
├── EtcdPublisher    <etcd.telemetry_prefix><node_id> = the reading as JSON, under a lease of a few intervals
└── HttpPublisher    GET /v1/telemetry → the latest reading (Authorization: Bearer <telemetry token>)
```

The etcd key lives exactly as long as its agent: each reading refreshes the lease, so an agent that dies (or a
host that goes down) leaves nothing behind once `telemetry.lease_ttl_s` has passed, and a clean stop revokes
the lease at once. A lease lost meanwhile (etcd was down for longer than its TTL) is replaced by a new one.

The HTTP endpoint uses aiohttp's low-level server (already the core's HTTP client library) on a socket bound the
way the daemon binds its own (`bind_listener`). It answers 503 while there is no reading (no NVML, a failed
reading), and 401 without the right token; the token is compared in constant time and never logged. It holds to
the daemon's limits on what an unauthenticated client may cost: a wrong token is logged with the client's address
and throttled per address (429 past a burst; a request without any token is refused uncounted), a request's
headers must be complete within a deadline (408), aiohttp bounds their size (400 past 8,190 bytes a line, 128
headers), one address holds a bounded number of connections (503), no body is ever read, and every answer closes
its connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import socket
from collections import Counter
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from qiip_core._errors import ConfigError, RegistryUnavailable
from qiip_core._lazy import LazyModule
from qiip_core.auth import AuthThrottle
from qiip_core.config import bind_listener
from qiip_core.storage import EtcdClient
from qiip_core.telemetry._types import TELEMETRY_PATH, NodeTelemetry

if TYPE_CHECKING:
    from etcd3gw import lease as etcd_lease
else:
    etcd_lease = LazyModule("etcd3gw.lease")  # loaded with the first etcd lease

__all__ = ["EtcdPublisher", "HttpPublisher", "Publisher", "encode_reading"]

logger = logging.getLogger("qiip.telemetry")


def encode_reading(reading: NodeTelemetry) -> bytes:
    """A reading as it crosses the wire: compact JSON."""
    return json.dumps(reading.model_dump(mode="json"), separators=(",", ":")).encode()


class Publisher:
    """Makes the agent's latest reading available to the gateways (a base: `publish` is each kind's own)."""

    async def start(self) -> None:
        """Get ready to publish (bind the endpoint). Raises `ConfigError` when that cannot be done."""

    async def publish(self, reading: NodeTelemetry) -> None:
        """Publish a new reading in place of the last one.

        Raises:
            RegistryUnavailable: etcd could not be written (the agent tries again at the next interval).
        """
        raise NotImplementedError

    async def withdraw(self, reason: str) -> None:
        """There is no reading to publish (no NVML, a failed reading): `reason` says why."""

    async def aclose(self) -> None:
        """Stop publishing and withdraw what was published, where that can be done at once."""


class EtcdPublisher(Publisher):
    """The reading at `key`, under an etcd lease refreshed at each reading.

    Args:
        client: the etcd client (`[etcd]`).
        key: `<etcd.telemetry_prefix><node_id>`.
        lease_ttl_s: the lease's TTL in seconds (`telemetry.lease_ttl_s`, a few intervals).
    """

    def __init__(self, client: EtcdClient, key: bytes, *, lease_ttl_s: int) -> None:
        self.client = client
        self.key = key
        self.lease_ttl_s = lease_ttl_s
        self.lease_id = 0
        """The lease the key is written under (0: none granted yet, or it was lost)."""

    def _write(self, value: bytes) -> None:
        if self.lease_id and self.client.refresh(self.lease_id) <= 0:
            logger.warning("telemetry: the etcd lease of %s had expired; granting a new one", self.key.decode())
            self.lease_id = 0
        if self.lease_id:
            self.client.put_with_lease(self.key, value, self.lease_id)
        else:
            # A failure between the grant and the put leaves a lease with nothing under it: it expires in a TTL.
            self.lease_id = self.client.put(self.key, value, lease_ttl_s=self.lease_ttl_s)

    async def publish(self, reading: NodeTelemetry) -> None:
        await asyncio.to_thread(self._write, encode_reading(reading))

    def _revoke(self) -> None:
        lease_id, self.lease_id = self.lease_id, 0
        try:
            if lease_id:
                self.client.call(lambda c: etcd_lease.Lease(lease_id, c).revoke())
        finally:
            self.client.close()

    async def aclose(self) -> None:
        try:
            await asyncio.to_thread(self._revoke)
        except RegistryUnavailable as exc:
            logger.warning(
                "telemetry: could not revoke the lease of %s (it expires by itself): %s", self.key.decode(), exc.message
            )


class HttpPublisher(Publisher):
    """The latest reading at `GET /v1/telemetry`, for a gateway with the embedded registry to poll.

    Args:
        host: the address to bind (`telemetry.listen_host`).
        port: the port (`telemetry.listen_port`; 0: any free port, then read `port`).
        token: the bearer token a poll must present (`telemetry.token_file` or `telemetry.token`).
        header_timeout_s: how long a request's headers may take from the connection's opening, in seconds
            (`server.header_timeout_s`); then 408 and the connection is closed.
        max_connections_per_address: connections one client address may hold (`server.max_connections_per_address`);
            its next one gets 503.
        auth_failure_burst: wrong tokens an address may present within `auth_failure_window_s`
            (`admin.auth_failure_burst`); beyond, 429 with `Retry-After`.
        auth_failure_window_s: the window wrong tokens are counted over, in seconds (`admin.auth_failure_window_s`).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        token: str,
        header_timeout_s: float = 30.0,
        max_connections_per_address: int = 256,
        auth_failure_burst: int = 10,
        auth_failure_window_s: float = 60.0,
    ) -> None:
        if not token:
            raise ConfigError(
                "The agent's HTTP endpoint needs a bearer token: set telemetry.token_file (or telemetry.token)."
            )
        self.host = host
        self.port = port
        self._token = token.encode()
        self._body: bytes | None = None
        self._reason = "no reading yet"
        self._runner: web.ServerRunner | None = None
        self._sock: socket.socket | None = None
        self.header_timeout_s = header_timeout_s
        self.max_connections_per_address = max_connections_per_address
        self.throttle = AuthThrottle(burst=auth_failure_burst, window_s=auth_failure_window_s)
        """Wrong tokens per client address."""
        self.connections: Counter[str] = Counter()
        """Open connections per client address."""

    def _error(self, status: int, message: str, code: str, **headers: str) -> web.Response:
        body = {"error": {"message": message, "type": "telemetry_error", "code": code, "param": None}}
        return web.json_response(body, status=status, headers=headers)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        response = self._answer(request)
        # One request a connection: a connection costs the agent one request's time at most.
        response.force_close()
        return response

    def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != TELEMETRY_PATH:
            return self._error(404, f"Not found; the agent serves GET {TELEMETRY_PATH}.", "not_found")
        if request.method not in ("GET", "HEAD"):
            return self._error(405, f"The agent serves GET {TELEMETRY_PATH}.", "method_not_allowed")
        peer = request.remote or "unknown"
        wait_s = self.throttle.retry_after_s(peer)
        if wait_s is not None:
            seconds = max(1, math.ceil(wait_s))
            return self._error(
                429,
                f"Too many wrong bearer tokens from this address; retry in {seconds} s.",
                "too_many_auth_failures",
                **{"Retry-After": str(seconds)},
            )
        given = request.headers.get("Authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(credential.strip().encode(), self._token):
            challenge = {"WWW-Authenticate": 'Bearer realm="qiip-agent"'}
            if not given.strip():
                return self._error(401, "A bearer token is required.", "unauthorized", **challenge)
            self.throttle.failed(peer)
            logger.warning("telemetry: a wrong bearer token from %s", peer)
            return self._error(401, "The bearer token was refused.", "unauthorized", **challenge)
        if self._body is None:
            return self._error(503, f"No GPU reading to publish: {self._reason}", "telemetry_unavailable")
        return web.Response(body=self._body, content_type="application/json")

    async def start(self) -> None:
        try:
            sock = bind_listener(self.host, self.port)
        except OSError as exc:
            raise ConfigError(
                f"The agent cannot listen on {self.host}:{self.port} ({exc.strerror or exc}); change "
                "telemetry.listen_host or telemetry.listen_port."
            ) from exc
        self.port = sock.getsockname()[1]
        runner = web.ServerRunner(_GuardedServer(self._handle, publisher=self), handle_signals=False)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        self._sock = sock
        logger.info("telemetry: serving GPU readings at http://%s:%d%s", self.host, self.port, TELEMETRY_PATH)

    async def publish(self, reading: NodeTelemetry) -> None:
        self._body = encode_reading(reading)

    async def withdraw(self, reason: str) -> None:
        self._body = None
        self._reason = reason

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _GuardedServer(web.Server):
    """aiohttp's low-level server, whose connections hold to `HttpPublisher`'s limits (`_GuardedConnection`)."""

    def __init__(self, handler: Any, *, publisher: HttpPublisher) -> None:
        super().__init__(handler, access_log=None)
        self.publisher = publisher

    def __call__(self) -> RequestHandler:
        return _GuardedConnection(self, loop=self._loop, **self._kwargs)


class _GuardedConnection(RequestHandler):
    """One client connection of the agent: refused past the per-address bound, and closed with 408 unless its
    request's headers arrive within `header_timeout_s` (aiohttp has no such deadline; its keep-alive timer is
    pushed back by every byte)."""

    _address: str | None = None
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(self._manager, _GuardedServer)
        publisher = self._manager.publisher
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if address is not None:
            if publisher.connections[address] >= publisher.max_connections_per_address:
                self._refuse(transport, "503 Service Unavailable", "Too many connections from this address.")
                return
            publisher.connections[address] += 1
            self._address = address
        self._deadline = self._loop.call_later(publisher.header_timeout_s, self._expired, transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        manager = self._manager
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._address is not None and isinstance(manager, _GuardedServer):
            connections = manager.publisher.connections
            connections[self._address] -= 1
            if connections[self._address] <= 0:
                del connections[self._address]
            self._address = None
        super().connection_lost(exc)

    def _expired(self, transport: asyncio.BaseTransport) -> None:
        self._deadline = None
        if self._current_request is None:
            self._refuse(transport, "408 Request Timeout", "The request was not received in time.")
        else:
            transport.close()

    @staticmethod
    def _refuse(transport: asyncio.BaseTransport, status: str, message: str) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        if not transport.is_closing():
            body = message.encode()
            head = (
                f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            ).encode()
            transport.write(head + body)
            transport.close()

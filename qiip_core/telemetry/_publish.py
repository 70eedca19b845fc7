"""Where `qiip agent` puts its readings: an etcd key under a lease, or a small authenticated HTTP endpoint.

```
Publisher            start() · publish(reading) · withdraw(reason) · aclose()
├── EtcdPublisher    <etcd.telemetry_prefix><node_id> = the reading as JSON, under a lease of a few intervals
└── HttpPublisher    GET /v1/telemetry → the latest reading (Authorization: Bearer <telemetry token>)
```

The etcd key lives exactly as long as its agent: each reading refreshes the lease, so an agent that dies (or a
host that goes down) leaves nothing behind once `telemetry.lease_ttl_s` has passed, and a clean stop revokes
the lease at once. A lease lost meanwhile (etcd was down for longer than its TTL) is replaced by a new one.

The HTTP endpoint uses aiohttp's server (already the core's HTTP client library) on a socket bound the way the
daemon binds its own (`bind_listener`). It answers 503 while there is no reading (no NVML, a failed reading),
and 401 without the right token; the token is compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket

from aiohttp import web
from etcd3gw.lease import Lease

from qiip_core._errors import ConfigError, RegistryUnavailable
from qiip_core.config import bind_listener
from qiip_core.storage import EtcdClient
from qiip_core.telemetry._types import TELEMETRY_PATH, NodeTelemetry

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
                self.client.call(lambda c: Lease(lease_id, c).revoke())
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
    """

    def __init__(self, *, host: str, port: int, token: str) -> None:
        if not token:
            raise ConfigError(
                "The agent's HTTP endpoint needs a bearer token: set telemetry.token_file (or telemetry.token)."
            )
        self.host = host
        self.port = port
        self._token = token.encode()
        self._body: bytes | None = None
        self._reason = "no reading yet"
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None

    def _error(self, status: int, message: str, code: str, **headers: str) -> web.Response:
        body = {"error": {"message": message, "type": "telemetry_error", "code": code, "param": None}}
        return web.json_response(body, status=status, headers=headers)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        scheme, _, credential = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(credential.strip().encode(), self._token):
            message = "A bearer token is required." if not given else "The bearer token was refused."
            return self._error(401, message, "unauthorized", **{"WWW-Authenticate": 'Bearer realm="qiip-agent"'})
        if self._body is None:
            return self._error(503, f"No GPU reading to publish: {self._reason}", "telemetry_unavailable")
        return web.Response(body=self._body, content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(TELEMETRY_PATH, self._handle)
        try:
            sock = bind_listener(self.host, self.port)
        except OSError as exc:
            raise ConfigError(
                f"The agent cannot listen on {self.host}:{self.port} ({exc.strerror or exc}); change "
                "telemetry.listen_host or telemetry.listen_port."
            ) from exc
        self.port = sock.getsockname()[1]
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
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

"""The HTTP server every serving process runs: uvicorn, with the daemon's limits and its shutdown order.

On SIGTERM/SIGINT the server stops accepting, closes idle connections and lets requests finish for
`server.shutdown_timeout_s`. At the end of that grace, a request still receiving its body (a slow upload) is ended
as if its client had left (its connection closed; it gets no answer and logs no error), and one second later
uvicorn cancels whatever still runs (a stream then ends with its in-band `gateway_shutdown` error).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from qiip_core.config import Settings
from qiip_proxy.server._connection_cap import capped_protocol
from qiip_proxy.server._gc import tune_gc
from qiip_proxy.server._transport import guarded_protocol

if TYPE_CHECKING:
    from qiip_proxy._types import ServingGateway

__all__ = ["UPLOADS_ENDED_BEFORE_S", "Server", "server_config"]

logger = logging.getLogger("qiip.proxy")

UPLOADS_ENDED_BEFORE_S = 1.0
"""How long before uvicorn cancels what still runs at the end of the shutdown grace the requests still receiving
their body are ended (quietly, as a client that left), so none of them is cancelled mid-read."""


def server_config(app: ASGIApp, settings: Settings, max_clients: int) -> uvicorn.Config:
    """uvicorn's configuration for `app`: no access log nor `Server` header, idle client connections kept for
    `server.keep_alive_s` (`timeout_keep_alive`), at most `max_clients` client connections, counted as they are
    accepted (`_connection_cap`; uvicorn's own `limit_concurrency`, checked per request, is not used), the
    transport limits of `_transport`, `server.shutdown_timeout_s` for the requests in flight at shutdown, and
    forwarded headers believed from `server.forwarded_allow_ips` only (uvicorn believes them from loopback unless
    told otherwise)."""
    server = settings.server
    guarded = guarded_protocol(
        max_header_bytes=server.max_header_bytes,
        header_timeout_s=server.header_timeout_s,
        body_timeout_s=server.body_timeout_s,
        max_connections_per_address=server.max_connections_per_address,
    )
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout_s + UPLOADS_ENDED_BEFORE_S),
        timeout_keep_alive=server.keep_alive_s,
        http=capped_protocol(guarded, max_connections=max_clients),
        lifespan="on",
        proxy_headers=bool(server.forwarded_allow_ips),
        forwarded_allow_ips=list(server.forwarded_allow_ips),
    )


class Server(uvicorn.Server):
    """uvicorn's server, which also tells the gateway when a shutdown begins: uvicorn then waits for open
    connections, and the admin event streams, which never end by themselves, must end first."""

    def __init__(self, gateway: ServingGateway, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        tune_gc()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace_s = self._gateway.settings.server.shutdown_timeout_s
        ending = asyncio.get_running_loop().call_later(grace_s, self._end_uploads, grace_s)
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()

    def _end_uploads(self, grace_s: float) -> None:
        """End every request still receiving its body: its connection closed, its app sees the client leave."""
        ended = 0
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_started and cycle.more_body:
                connection.transport.close()
                ended += 1
        if ended:
            logger.info("shutdown: %d request(s) still sending their body after %g s were ended", ended, grace_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            # A signal handler: hand the work to the loop rather than touch its state from here.
            self._loop.call_soon_threadsafe(self._gateway.begin_shutdown)

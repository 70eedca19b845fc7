"""The HTTP server every serving process runs: uvicorn, with the daemon's limits and its shutdown order.

On SIGTERM/SIGINT the server stops accepting, closes idle connections and lets requests finish for
`server.shutdown_timeout_s`. At the end of that grace, a request still receiving its body (a slow upload) is ended
as if its client had left (its connection closed; it gets no answer and logs no error), and one second later
uvicorn cancels whatever still runs (a stream then ends with its in-band `gateway_shutdown` error). That end is
expected, so it is logged as a warning (`shutdown: N request(s) still open after G s were ended`) rather than as
uvicorn's error line.

A SIGINT during that grace forces the stop, as uvicorn's own second Ctrl-C does: the wait ends at once. uvicorn
would then leave the requests still open running and skip the app's lifespan shutdown; here they are ended as at
the end of the grace (a stream gets its error event and `[DONE]`), and the lifespan still stops the gateway, so no
local llama-server outlives the daemon.
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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from qiip_core.config import Settings
from qiip_proxy.server._connection_cap import capped_protocol
from qiip_proxy.server._fast import DirectRoute, direct_protocol
from qiip_proxy.server._gc import tune_gc
from qiip_proxy.server._transport import guarded_protocol

if TYPE_CHECKING:
    from qiip_proxy._types import ServingGateway

__all__ = ["UPLOADS_ENDED_BEFORE_S", "Server", "server_config"]

logger = logging.getLogger("qiip.proxy")

_GRACE_EXCEEDED = "Cancel %s running task(s), timeout graceful shutdown exceeded"
"""uvicorn's error line at the end of the shutdown grace (`uvicorn.Server.shutdown`), logged here as a warning."""

FORCED_END_WAIT_S = 5.0
"""How long a forced stop waits for the requests it ended to send their last bytes (a stream's error event and
`[DONE]`) before the gateway stops; they end in milliseconds unless the loop is starved."""

UPLOADS_ENDED_BEFORE_S = 1.0
"""How long before uvicorn cancels what still runs at the end of the shutdown grace the requests still receiving
their body are ended (quietly, as a client that left), so none of them is cancelled mid-read."""


def server_config(
    app: ASGIApp, settings: Settings, max_clients: int, *, direct: DirectRoute | None = None
) -> uvicorn.Config:
    """uvicorn's configuration for `app`: no access log nor `Server` header, idle client connections kept for
    `server.keep_alive_s` (`timeout_keep_alive`), at most `max_clients` client connections, counted as they are
    accepted (`_connection_cap`; uvicorn's own `limit_concurrency`, checked per request, is not used), the
    transport limits of `_transport`, `server.shutdown_timeout_s` for the requests in flight at shutdown, and
    forwarded headers believed from `server.forwarded_allow_ips` only (uvicorn believes them from loopback unless
    told otherwise).

    Args:
        app: the ASGI application.
        settings: the daemon's settings.
        max_clients: client connections this process holds at once.
        direct: paths the protocol answers itself, ahead of `app` (`_fast`; `_app.direct_route`).
    """
    server = settings.server
    base = direct_protocol(HttpToolsProtocol, direct) if direct is not None else HttpToolsProtocol
    guarded = guarded_protocol(
        base=base,
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


class _GraceEndedIsExpected(logging.Filter):
    """Turns uvicorn's error line at the end of the shutdown grace into the warning it is: the grace is the
    operator's setting, and ending what still runs after it is the documented behaviour, not a fault."""

    def __init__(self, grace_s: float) -> None:
        super().__init__()
        self.grace_s = grace_s

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _GRACE_EXCEEDED and isinstance(record.args, tuple) and len(record.args) == 1:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = "shutdown: %s request(s) still open after %g s were ended"
            record.args = (record.args[0], self.grace_s)
        return True


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
        expected = _GraceEndedIsExpected(grace_s)
        uvicorn_logger = logging.getLogger("uvicorn.error")
        uvicorn_logger.addFilter(expected)
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                await self._end_forced()
        finally:
            ending.cancel()
            uvicorn_logger.removeFilter(expected)

    async def _end_forced(self) -> None:
        """After a forced stop: end the requests still open as the end of the grace would, then run the lifespan's
        shutdown, which uvicorn skips on a forced exit and which stops the gateway and its local llama-servers."""
        self._gateway.force_shutdown()
        self._end_uploads(None)
        running = list(self.server_state.tasks)
        for task in running:
            task.cancel(msg="Task cancelled, shutdown forced")
        if running:
            logger.warning("shutdown forced (a second SIGINT): %d request(s) still open were ended", len(running))
            await asyncio.wait(running, timeout=FORCED_END_WAIT_S)
        await self.lifespan.shutdown()

    def _end_uploads(self, grace_s: float | None) -> None:
        """End every request still receiving its body: its connection closed, its app sees the client leave."""
        ended = 0
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_started and cycle.more_body:
                connection.transport.close()
                ended += 1
        if ended and grace_s is not None:
            logger.info("shutdown: %d request(s) still sending their body after %g s were ended", ended, grace_s)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            # A signal handler: hand the work to the loop rather than touch its state from here.
            self._loop.call_soon_threadsafe(self._gateway.begin_shutdown)

"""The HTTP server every serving process runs: uvicorn, with the daemon's limits and its shutdown order."""

from __future__ import annotations

import asyncio
import socket
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from starlette.types import ASGIApp

from qiip_core.config import Settings
from qiip_proxy._connection_cap import capped_protocol
from qiip_proxy._gc import tune_gc
from qiip_proxy._transport import guarded_protocol

if TYPE_CHECKING:
    from qiip_proxy._gateway import Gateway

__all__ = ["Server", "server_config"]


def server_config(app: ASGIApp, settings: Settings, max_clients: int) -> uvicorn.Config:
    """uvicorn's configuration for `app`: no access log nor `Server` header, idle client connections kept for
    `server.keep_alive_s` (`timeout_keep_alive`), at most `max_clients` client connections, counted as they are
    accepted (`_connection_cap`; uvicorn's own `limit_concurrency`, checked per request, is not used), the
    transport limits of `_transport`, and `server.shutdown_timeout_s` for the requests in flight at shutdown."""
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
        timeout_graceful_shutdown=int(server.shutdown_timeout_s),
        timeout_keep_alive=server.keep_alive_s,
        http=capped_protocol(guarded, max_connections=max_clients),
        lifespan="on",
    )


class Server(uvicorn.Server):
    """uvicorn's server, which also tells the gateway when a shutdown begins: uvicorn then waits for open
    connections, and the admin event streams, which never end by themselves, must end first."""

    def __init__(self, gateway: Gateway, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        tune_gc()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            # A signal handler: hand the work to the loop rather than touch its state from here.
            self._loop.call_soon_threadsafe(self._gateway.begin_shutdown)

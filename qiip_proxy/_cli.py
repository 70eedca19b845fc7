"""`qiip-proxy`: run the daemon.

Stages: settings are loaded and checked (an invalid one stops start-up with exit status 2 and a message
naming it), logging is configured, the listening socket is bound (a port in use stops start-up the same
way, before anything else starts), then uvicorn serves the app on it, keeping an idle client connection
open for `server.keep_alive_s` (uvicorn's `timeout_keep_alive`); the app's lifespan starts the gateway.
SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
`server.shutdown_timeout_s`, then stop the gateway (and any local llama-server).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from types import FrameType

import click
import uvicorn

import qiip_core
from qiip_core import ConfigError
from qiip_core._logging import configure_logging
from qiip_core.config import bind_listener, load_settings
from qiip_proxy._app import create_app, serving_app
from qiip_proxy._gateway import Gateway
from qiip_proxy._gc import tune_gc
from qiip_proxy._limits import client_connection_cap, raise_open_file_limit
from qiip_proxy._transport import guarded_protocol

__all__ = ["main"]


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket, or say plainly why not."""
    try:
        return bind_listener(host, port)
    except socket.gaierror as exc:
        raise ConfigError(f"The address {host!r} (server.host) cannot be resolved: {exc.strerror}.") from exc
    except OSError as exc:
        raise ConfigError(
            f"Cannot listen on {host}:{port}: {exc.strerror}; choose another port with --port or server.port."
        ) from exc


class _Server(uvicorn.Server):
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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="QIIP_CONFIG",
    help="TOML config file (also QIIP_CONFIG).",
)
@click.option("--host", help="Address to bind (overrides server.host; default 127.0.0.1).")
@click.option("--port", type=click.IntRange(1, 65535), help="Port to bind (overrides server.port; default 8080).")
@click.version_option(qiip_core.__version__, prog_name="qiip-proxy")
def main(config: Path | None, host: str | None, port: int | None) -> None:
    """Run the QIIP daemon: the OpenAI-compatible API over the configured nodes."""
    server_overrides: dict[str, object] = {}
    if host is not None:
        server_overrides["host"] = host
    if port is not None:
        server_overrides["port"] = port
    try:
        settings = load_settings(config, **({"server": server_overrides} if server_overrides else {}))
        configure_logging(level=settings.logging.level, format=settings.logging.format)
        sock = _bind(settings.server.host, settings.server.port)
        open_files = raise_open_file_limit()
        max_clients = client_connection_cap(settings, open_files)
        app = create_app(settings)
    except ConfigError as exc:
        click.echo(f"qiip-proxy: {exc.message}", err=True)
        sys.exit(2)
    server = _Server(
        app.state.gateway,
        uvicorn.Config(
            serving_app(app),
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=int(settings.server.shutdown_timeout_s),
            timeout_keep_alive=settings.server.keep_alive_s,
            limit_concurrency=max_clients,
            http=guarded_protocol(
                max_header_bytes=settings.server.max_header_bytes,
                header_timeout_s=settings.server.header_timeout_s,
                body_timeout_s=settings.server.body_timeout_s,
                max_connections_per_address=settings.server.max_connections_per_address,
            ),
            lifespan="on",
        ),
    )
    logging.getLogger("qiip.proxy").info(
        "serving at most %d client connections (open-file limit %d)", max_clients, open_files
    )
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)

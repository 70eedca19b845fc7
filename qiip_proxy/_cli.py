"""`qiip-proxy`: run the daemon.

Stages: settings are loaded and checked, with the local nodes `qiip up` hands over in `QIIP_LOCAL_NODE_PLAN` (an
invalid one stops start-up with exit status 2 and a message naming it), logging is configured, the listening socket
is bound (a port in use stops start-up the same way, before anything else starts), then uvicorn serves the app on
it, keeping an idle client connection open for `server.keep_alive_s` (uvicorn's `timeout_keep_alive`); the app's
lifespan starts the gateway. SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
`server.shutdown_timeout_s`, then stop the gateway (and any local llama-server); a SIGINT during that grace forces
the stop (`server._server`): the requests still open end at once, and the gateway still stops.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import sys
from pathlib import Path

import click

import qiip_core
from qiip_core import ConfigError
from qiip_core._logging import configure_logging
from qiip_core.config import bind_listener, check_settings_names, load_settings
from qiip_core.engines.llamacpp import LocalNodeHandoff
from qiip_core.routing import InFlightBoard
from qiip_proxy._app import create_app, direct_route, serving_app
from qiip_proxy._gateway import Gateway
from qiip_proxy._worker import run_worker
from qiip_proxy._workers import ADMIN_SOCKET, BOARD_FILE, WorkerPeer, WorkerSpec, create_runtime_dir
from qiip_proxy.server._limits import client_connection_cap, raise_open_file_limit
from qiip_proxy.server._server import Server, server_config

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


def _hash_seed_shared() -> None:
    """Make sure worker processes hash strings as this one does, or return without changing anything.

    Prefix affinity keys its map by Python's `hash` of the prompt's blocks, and the processes share that map
    (`_workers`); Python seeds its string hash at random in every process unless `PYTHONHASHSEED` is set. When it
    is not (or is `random`, a new seed per process), set it to a random number (so the seed stays secret from
    clients, as the default's is) and start this process again with it (`os.execv`: the same process id, arguments
    and environment otherwise); the workers inherit it. The same practice as Spark's for its Python workers.
    """
    if os.environ.get("PYTHONHASHSEED", "").isdigit():
        return
    os.environ["PYTHONHASHSEED"] = str(secrets.randbelow(2**32 - 1) + 1)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


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
    runtime_dir: Path | None = None
    try:
        # The local nodes `qiip up` planned replace any configured ones, as their settings beat the file's.
        handoff = LocalNodeHandoff.from_environ(os.environ)
        overrides: dict[str, object] = {"server": server_overrides} if server_overrides else {}
        if handoff is not None:
            overrides["local_nodes"] = [node.config() for node in handoff.nodes]
        settings = load_settings(config, **overrides)
        configure_logging(level=settings.logging.level, format=settings.logging.format)
        check_settings_names(settings)
        workers = settings.server.worker_count()
        if workers > 1:
            _hash_seed_shared()
        sock = _bind(settings.server.host, settings.server.port)
        open_files = raise_open_file_limit()
        max_clients = client_connection_cap(settings, open_files)
        board = spec = None
        if workers > 1:
            runtime_dir = create_runtime_dir()
            board = InFlightBoard.create(runtime_dir / BOARD_FILE, rows=workers)
            spec = WorkerSpec(listener=sock, runtime_dir=runtime_dir, count=workers, target=run_worker)
        gateway = Gateway(settings, board=board, workers=spec, handoff=handoff)
        app = create_app(gateway)
    except ConfigError as exc:
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        click.echo(f"qiip-proxy: {exc.message}", err=True)
        sys.exit(2)
    sockets = [sock]
    if runtime_dir is not None:
        admin_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        admin_sock.bind(str(runtime_dir / ADMIN_SOCKET))
        sockets.append(admin_sock)
    served = serving_app(app)
    if runtime_dir is not None:
        served = WorkerPeer(served)
    server = Server(gateway, server_config(served, settings, max_clients, direct=direct_route(gateway)))
    logging.getLogger("qiip.proxy").info(
        "serving at most %d client connections (open-file limit %d)%s",
        max_clients,
        open_files,
        f", in each of {workers} processes" if workers > 1 else "",
    )
    try:
        server.run(sockets=sockets)
    finally:
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    if not server.started:
        sys.exit(3)

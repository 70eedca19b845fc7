"""`qiip agent`: the telemetry agent of a GPU node, wired from the settings (the work is `qiip_core.telemetry`'s).

With `registry.backend = "etcd"` it writes each reading to etcd under a lease; with the embedded registry it
serves the latest reading at `GET /v1/telemetry` for the gateway to poll. It runs until SIGINT, SIGTERM or
SIGHUP, then withdraws what it published (revokes its lease, closes its endpoint) and exits 0.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core._logging import configure_logging
from qiip_core.config import Settings
from qiip_core.discovery import read_token_file
from qiip_core.storage import EtcdClient
from qiip_core.telemetry import NODE_ID_PATTERN, EtcdPublisher, HttpPublisher, Publisher, TelemetryAgent

__all__ = ["agent"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _publisher(settings: Settings, node_id: str) -> Publisher:
    telemetry = settings.telemetry
    if settings.registry.backend == "etcd":
        key = (settings.etcd.telemetry_prefix + node_id).encode()
        return EtcdPublisher(EtcdClient(settings.etcd), key, lease_ttl_s=telemetry.lease_ttl_s)
    if telemetry.token_file is not None:
        token = read_token_file(telemetry.token_file, setting="telemetry.token_file", what="token file")
    elif telemetry.token is not None:
        token = telemetry.token.get_secret_value()
    else:
        token = ""
    # The daemon's limits on what an unauthenticated client may cost, from the same settings.
    return HttpPublisher(
        host=telemetry.listen_host,
        port=telemetry.listen_port,
        token=token,
        header_timeout_s=settings.server.header_timeout_s,
        max_connections_per_address=settings.server.max_connections_per_address,
        auth_failure_burst=settings.admin.auth_failure_burst,
        auth_failure_window_s=settings.admin.auth_failure_window_s,
    )


async def _run(telemetry_agent: TelemetryAgent) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        await telemetry_agent.run(stop)
    finally:
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@click.command()
@click.option("--node-id", help="The node id to publish under (default: telemetry.node_id, else the host's name).")
@pass_cli
def agent(ctx: CliContext, node_id: str | None) -> None:
    """Publish this host's live GPU readings (NVML) for the gateways.

    Every telemetry.interval_s it reads each NVIDIA GPU: memory used and total, utilisation, temperature, power
    and the processes using it. With the etcd registry the reading goes to etcd under a lease of a few
    intervals; with the embedded registry it is served at GET /v1/telemetry (bearer token: telemetry.token_file)
    on telemetry.listen_host:listen_port. A host without an NVIDIA driver is reported once and publishes nothing
    while the agent keeps trying. Stop it with SIGTERM or Ctrl-C.
    """
    settings = ctx.settings
    configure_logging(level=settings.logging.level, format=settings.logging.format)
    hostname = socket.gethostname()
    node = node_id or settings.telemetry.node_id or hostname
    if len(node) > 128 or not re.match(NODE_ID_PATTERN, node):
        click.echo(
            f"error: the node id {node!r} is not one a node can have: up to 128 letters, digits, '.', '_', ':' and "
            "'-', starting with a letter or digit; give --node-id.",
            err=True,
        )
        sys.exit(1)
    publisher = run_or_exit(lambda: _publisher(settings, node))
    telemetry_agent = TelemetryAgent(
        publisher, node_id=node, hostname=hostname, interval_s=settings.telemetry.interval_s
    )
    run_or_exit(lambda: asyncio.run(_run(telemetry_agent)))

"""`qiip-proxy`: run the daemon.

Stages, as uvicorn runs them: settings are loaded and checked (an invalid one stops start-up with exit
status 2 and a message naming it), logging is configured, then uvicorn serves the app; its lifespan starts
the gateway. SIGINT/SIGTERM stop accepting connections, let in-flight requests finish for up to
`server.shutdown_timeout_s`, then stop the gateway (and any local llama-server).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import uvicorn

from qiip_core import ConfigError
from qiip_core._logging import configure_logging
from qiip_core.config import load_settings
from qiip_proxy._app import create_app, serving_app

__all__ = ["main"]


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="QIIP_CONFIG",
    help="TOML config file (also QIIP_CONFIG).",
)
@click.option("--host", help="Address to bind (overrides server.host; default 127.0.0.1).")
@click.option("--port", type=int, help="Port to bind (overrides server.port; default 8080).")
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
        app = create_app(settings)
    except ConfigError as exc:
        click.echo(f"qiip-proxy: {exc.message}", err=True)
        sys.exit(2)
    uvicorn.run(
        serving_app(app),
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.server.shutdown_timeout_s),
        lifespan="on",
    )

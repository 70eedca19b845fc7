"""`qiip console`: the operator console, a Textual app talking to a running daemon."""

from __future__ import annotations

import click

from qiip_cli._main import cli

__all__ = ["console"]


@cli.command("console")
@click.option(
    "--url",
    envvar="QIIP_URL",
    default="http://127.0.0.1:8080",
    show_default=True,
    help="The daemon's base URL (also QIIP_URL).",
)
def console(url: str) -> None:
    """Open the operator console against the daemon at URL."""
    from qiip_tui import QiipConsole  # the console's dependencies load only for this command

    QiipConsole(url=url).run()

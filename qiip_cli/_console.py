"""`qiip console`: the operator console, a Textual app talking to a running daemon.

The daemon's URL and the admin credentials come from `--url`, then `QIIP_URL`, `QIIP_ADMIN__USERNAME`,
`QIIP_ADMIN__PASSWORD` and `QIIP_TOKEN`, then `console.toml` (`QIIP_CONSOLE_CONFIG`, else
`$XDG_CONFIG_HOME/qiip/console.toml`, else the one `qiip up` writes in the state directory); see
`qiip_core.client.load_console_config`. A config file others can read is refused with one `error:` line.
"""

from __future__ import annotations

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core.client import load_console_config

__all__ = ["console"]


@click.command("console")
@click.option(
    "--url",
    default=None,
    help="The daemon's base URL; beats QIIP_URL and console.toml (default http://127.0.0.1:8080).",
)
@pass_cli
def console(context: CliContext, url: str | None) -> None:
    """Open the operator console on the daemon at URL."""
    config = run_or_exit(lambda: load_console_config(url=url, state_dir=context.settings.state_dir))
    from qiip_tui import QiipConsole  # the console's dependencies load only for this command

    QiipConsole(config).run()

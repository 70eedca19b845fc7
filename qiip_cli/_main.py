"""The `qiip` command group, and the one place every subcommand is added to it.

Each subcommand (or group of them) lives in its own module, which imports only `_context` for what commands share;
this module imports them and adds them with `cli.add_command`, so imports point one way: `_main` → commands →
`_context`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from qiip_cli._agent import agent
from qiip_cli._catalog import download, list_models
from qiip_cli._client_config import client_config
from qiip_cli._console import console
from qiip_cli._context import CliContext
from qiip_cli._deploy import deploy, host
from qiip_cli._engine import engine
from qiip_cli._manifests import acquire, pause, register, status, verify
from qiip_cli._model import model
from qiip_cli._node import node, registry
from qiip_cli._up import up

__all__ = ["cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.option(
    "--config",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="QIIP_CONFIG",
    help="TOML config file (also QIIP_CONFIG).",
)
@click.version_option(package_name="qiip")
@click.pass_context
def cli(ctx: click.Context, config: Path | None) -> None:
    """QIIP: one OpenAI-compatible endpoint over a fleet of llama.cpp and vLLM nodes.

    Bare `qiip` in a terminal opens the operator console (`qiip console`); elsewhere it prints this help.
    """
    ctx.obj = CliContext(config)
    if ctx.invoked_subcommand is None:
        if sys.stdin.isatty() and sys.stdout.isatty():
            ctx.invoke(console)
        else:
            click.echo(ctx.get_help())


cli.add_command(agent)
cli.add_command(client_config)
cli.add_command(console)
cli.add_command(deploy)
cli.add_command(engine)
cli.add_command(host)
cli.add_command(model)
model.add_command(list_models)
model.add_command(download)
for command in (register, acquire, pause, status, verify):
    model.add_command(command)
cli.add_command(node)
cli.add_command(registry)
cli.add_command(up)

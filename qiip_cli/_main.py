"""The `qiip` command group, and the one place every subcommand is added to it.

Each subcommand (or group of them) lives in its own module, which imports only `_context` for what commands share;
this module names them in `COMMANDS` and imports one when a command line first names it (a command starts without
the others' imports), so imports point one way: `_main` → commands → `_context`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from qiip_cli._context import CliContext

__all__ = ["cli"]


class LazyGroup(click.Group):
    """A command group whose subcommands are imported when a command line first names them (Click's documented
    pattern, "Lazily Loading Subcommands"): `qiip node list` loads the node commands and what they import, not the
    deployment controller's models, the agent or the console. `--help` lists every command, so it loads them all.

    Args:
        loaders: subcommand name → a function returning the command (importing its module).
    """

    def __init__(self, *args: Any, loaders: Mapping[str, Callable[[], click.Command]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loaders = dict(loaders)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.loaders})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self.loaders:
            command = self.loaders[cmd_name]()
            self.add_command(command, cmd_name)
        return command


def _imported(module: str, name: str) -> Callable[[], click.Command]:
    def load() -> click.Command:
        command = getattr(importlib.import_module(module), name)
        assert isinstance(command, click.Command)
        return command

    return load


def _model_group() -> click.Command:
    """`qiip model`: its own commands (`_model`), the catalog's (`_catalog`) and the manifests' (`_manifests`)."""
    from qiip_cli._catalog import download, list_models
    from qiip_cli._manifests import acquire, pause, register, status, verify
    from qiip_cli._model import model

    for command in (list_models, download, register, acquire, pause, status, verify):
        model.add_command(command)
    return model


COMMANDS: dict[str, Callable[[], click.Command]] = {
    "agent": _imported("qiip_cli._agent", "agent"),
    "client-config": _imported("qiip_cli._client_config", "client_config"),
    "console": _imported("qiip_cli._console", "console"),
    "deploy": _imported("qiip_cli._deploy", "deploy"),
    "engine": _imported("qiip_cli._engine", "engine"),
    "host": _imported("qiip_cli._deploy", "host"),
    "model": _model_group,
    "node": _imported("qiip_cli._node", "node"),
    "registry": _imported("qiip_cli._node", "registry"),
    "state": _imported("qiip_cli._state", "state"),
    "up": _imported("qiip_cli._up", "up"),
}
"""Every `qiip` subcommand by name, and where it is defined."""


@click.group(
    cls=LazyGroup,
    loaders=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=True,
)
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
            console = cli.get_command(ctx, "console")
            assert console is not None
            ctx.invoke(console)
        else:
            click.echo(ctx.get_help())

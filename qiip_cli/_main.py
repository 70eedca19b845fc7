"""The `qiip` command group. Each subcommand group lives in its own module and registers here."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from qiip_core import QiipError
from qiip_core.config import Settings, load_settings

__all__ = ["CliContext", "cli", "pass_cli", "run_or_exit"]

T = TypeVar("T")


def run_or_exit(fn: Callable[[], T]) -> T:
    """Run `fn`; a `QiipError` becomes `error: <message>` on stderr and exit status 1."""
    try:
        return fn()
    except QiipError as exc:
        click.echo(f"error: {exc.message}", err=True)
        sys.exit(1)


class CliContext:
    """What every subcommand gets: the `--config` path and the settings, loaded on first use."""

    def __init__(self, config: Path | None) -> None:
        self.config = config
        self._settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        """The settings; an invalid value ends the command with the precise message."""
        if self._settings is None:
            self._settings = run_or_exit(lambda: load_settings(self.config))
        return self._settings


pass_cli = click.make_pass_decorator(CliContext)
"""Decorator giving a command the `CliContext` as its first argument."""


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
            from qiip_cli._console import console

            ctx.invoke(console)
        else:
            click.echo(ctx.get_help())


def _register() -> None:
    # Subcommand modules import this one for `cli`; registering them last avoids an import cycle.
    from qiip_cli import _console, _engine, _model, _node, _up  # noqa: F401


_register()

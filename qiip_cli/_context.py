"""What every `qiip` subcommand shares: the `CliContext` (the `--config` path and the settings), `pass_cli` to
receive it, and `run_or_exit` to turn a `QiipError` into one `error:` line and exit status 1.

The command modules (`_console`, `_engine`, `_model`, `_node`, `_up`) import this module and nothing of the
group's; `_main` names each in one place and imports it when a command line first names it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from qiip_core import QiipError

if TYPE_CHECKING:
    from qiip_core.config import Settings

__all__ = ["CliContext", "pass_cli", "run_or_exit"]

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
            # Imported here: the settings' models are most of a command's start-up, and some commands never read them.
            from qiip_core.config import load_settings

            self._settings = run_or_exit(lambda: load_settings(self.config))
        return self._settings


pass_cli = click.make_pass_decorator(CliContext)
"""Decorator giving a command the `CliContext` as its first argument."""

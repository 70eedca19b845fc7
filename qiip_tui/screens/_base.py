"""The base of the console's full screens."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, cast

from textual.screen import Screen

if TYPE_CHECKING:
    from qiip_tui._app import QiipConsole

__all__ = ["ConsoleScreen"]

ResultT = TypeVar("ResultT")


class ConsoleScreen(Screen[ResultT]):
    """A screen of the console, which reaches the app's fleet, client and actions through `console`."""

    @property
    def console(self) -> QiipConsole:
        """The app, typed."""
        return cast("QiipConsole", self.app)

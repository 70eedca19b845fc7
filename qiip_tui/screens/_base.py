"""The base of the console's full screens."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, cast

from textual.screen import Screen

if TYPE_CHECKING:
    from textual.binding import ActiveBinding

    from qiip_tui._context import ConsoleContext

__all__ = ["FOOTER_FIRST", "ConsoleScreen"]

ResultT = TypeVar("ResultT")

FOOTER_FIRST = ("q", "question_mark", "colon")
"""Keys the footer shows first, so that no terminal width cuts them: quit or back, the key map, the command line."""


class ConsoleScreen(Screen[ResultT]):
    """A screen of the console, which reaches the app's fleet, client and actions through `console`."""

    @property
    def console(self) -> ConsoleContext:
        """The app, as the protocol of what a screen uses of it (the app module is never imported here)."""
        return cast("ConsoleContext", self.app)

    @property
    def active_bindings(self) -> dict[str, ActiveBinding]:
        """Textual's active bindings, with the keys of `FOOTER_FIRST` moved to the front.

        The footer shows bindings in this order and cuts what does not fit; the focused widget's come first,
        the app's last, so at 80 columns `?` (an app key) and `q` would be cut.
        """
        bindings = super().active_bindings
        first = {key: bindings[key] for key in FOOTER_FIRST if key in bindings}
        return first | {key: active for key, active in bindings.items() if key not in first}

"""The key map (`?`): every key the screen underneath answers, what it does, and where it applies, in plain words
(this table, this field, this screen, everywhere) rather than the names of the widgets behind them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import ActiveBinding, Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import DataTable, Input, Label

from qiip_tui.widgets import ConsoleTable, LogView

__all__ = ["HelpScreen", "key_map", "screen_name"]


def screen_name(screen: Screen[object]) -> str:
    """What the key map calls `screen`: its `KEY_MAP_NAME` when it has one, else its class name without
    `Screen` or `Modal` (`FleetScreen` -> `fleet`)."""
    name = getattr(screen, "KEY_MAP_NAME", None)
    if isinstance(name, str):
        return name
    return type(screen).__name__.removesuffix("Screen").removesuffix("Modal").lower()


_PLAIN_WORDS = {
    "app.focus_next": "Next field or table",
    "app.focus_previous": "Previous field or table",
    "screen.copy_text": "Copy the selected text",
    "copy": "Copy the selected text",
    "submit": "Submit",
    "show_overlay": "Open the list",
    "press": "Press the button",
    "page_left": "Page left",
    "page_right": "Page right",
    "command_palette": "The command palette",
}
"""Plain words for the actions of Textual's own bindings that the key map shows."""


def _where(node: object) -> tuple[str, int]:
    """Where a binding of `node` applies, in an operator's words, and its rank (the focused widget first)."""
    if isinstance(node, Screen):
        return "this screen", 1
    if isinstance(node, DataTable):
        return "this table", 0
    if isinstance(node, Input):
        return "this field", 0
    if isinstance(node, LogView):
        return "the log", 0
    if isinstance(node, Widget):
        where = getattr(node, "KEY_MAP_WHERE", None)
        return (where if isinstance(where, str) else "this panel"), 0
    return "everywhere", 2


def _shown(active: ActiveBinding) -> bool:
    binding, node = active.binding, active.node
    if not binding.description:
        return False
    if isinstance(node, Input) and not binding.show:
        # A text field's editing keys (arrows, Home, Ctrl+A, …) are every text field's; only Enter is named.
        return binding.action == "submit"
    return True


def key_map(bindings: Iterable[ActiveBinding], *, key_display: dict[str, str]) -> list[tuple[str, str, str]]:
    """Rows of the key map: key, action, where it applies (this table, this field, this screen, everywhere).

    Every active key with a description is listed, the cursor keys of tables too; a text field's editing keys
    are not (only its Enter). Keys of one binding, or of several bindings doing the same thing in the same
    place, share a row (`↑ / k`).

    Args:
        bindings: `Screen.active_bindings` of the screen the help is for, in its order.
        key_display: how to show each binding's key (the app's `get_key_display`), by key.

    Returns:
        One row per described action, the focused widget's keys first, then the screen's, then the app's.
    """
    rows: list[tuple[int, str, str, str]] = []
    seen: dict[tuple[str, str], int] = {}
    for active in bindings:
        if not _shown(active):
            continue
        binding = active.binding
        description = _PLAIN_WORDS.get(binding.action, binding.description)
        where, rank = _where(active.node)
        key = key_display.get(binding.key, binding.key)
        index = seen.get((description, where))
        if index is not None:
            rank, keys, description, where = rows[index]
            if key not in keys.split(" / "):
                rows[index] = (rank, f"{keys} / {key}", description, where)
            continue
        seen[(description, where)] = len(rows)
        rows.append((rank, key, description, where))
    return [(key, action, where) for _, key, action, where in sorted(rows, key=lambda row: row[0])]


class HelpScreen(ModalScreen[None]):
    """The key map, over the screen it is for.

    Args:
        rows: `key_map()` of that screen.
        title: the screen's name.
    """

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss", "Close")]
    """
    | Key | Action |
    | :- | :- |
    | escape, q, ? | Close. |
    """

    def __init__(self, rows: list[tuple[str, str, str]], *, title: str) -> None:
        super().__init__()
        self.rows = rows
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Label(f"Keys: {self.title_text}", id="help-title")
            yield ConsoleTable[str](id="help-keys", cursor_type="none", zebra_stripes=True)
            yield Label(": a command by name (Tab completes). Ctrl+P: every action. Mouse works too.", id="help-hint")

    def on_mount(self) -> None:
        table = self.query_one("#help-keys", DataTable)
        table.add_columns("key", "action", "where")
        table.add_rows(self.rows)

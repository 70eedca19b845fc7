"""The key map (`?`): every key the screen underneath answers, where it applies, and what it does."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import ActiveBinding, Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import DataTable, Label

__all__ = ["HelpScreen", "key_map", "screen_name"]


def screen_name(screen: Screen[object]) -> str:
    """What the key map calls `screen`: its `KEY_MAP_NAME` when it has one, else its class name without
    `Screen` or `Modal` (`FleetScreen` -> `fleet`)."""
    name = getattr(screen, "KEY_MAP_NAME", None)
    if isinstance(name, str):
        return name
    return type(screen).__name__.removesuffix("Screen").removesuffix("Modal").lower()


def key_map(bindings: Iterable[ActiveBinding], *, key_display: dict[str, str]) -> list[tuple[str, str, str]]:
    """Rows of the key map: key, action, where it applies (this screen, a widget, everywhere).

    Args:
        bindings: `Screen.active_bindings` of the screen the help is for, in its order.
        key_display: how to show each binding's key (the app's `get_key_display`), by key.

    Returns:
        One row per described binding, widget and screen keys first, the app's last.
    """
    rows: list[tuple[int, str, str, str]] = []
    seen: dict[tuple[str, str], int] = {}
    for active in bindings:
        binding = active.binding
        node = active.node
        if not binding.description or (isinstance(node, Widget) and not isinstance(node, Screen) and not binding.show):
            # A widget's hidden bindings are its cursor keys (arrows, paging), which need no map.
            continue
        if isinstance(node, Screen):
            where, rank = "this screen", 1
        elif isinstance(node, Widget):
            where, rank = type(node).__name__, 0
        else:
            where, rank = "everywhere", 2
        key = key_display.get(binding.key, binding.key)
        index = seen.get((binding.description, where))
        if index is not None:
            # One binding with several keys (`escape,q`): one row, every key.
            rank, keys, description, where = rows[index]
            if key not in keys.split(" / "):
                rows[index] = (rank, f"{keys} / {key}", description, where)
            continue
        seen[(binding.description, where)] = len(rows)
        rows.append((rank, key, binding.description, where))
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
            yield DataTable[str](id="help-keys", cursor_type="none", zebra_stripes=True)
            yield Label("Ctrl+P: every action, by name. Mouse works too.", id="help-hint")

    def on_mount(self) -> None:
        table = self.query_one("#help-keys", DataTable)
        table.add_columns("key", "action", "where")
        table.add_rows(self.rows)

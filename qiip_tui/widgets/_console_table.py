"""The keys every table of the console answers, the same in each: the arrows and j/k, paging, and first/last row.

Textual's DataTable binds Home and End to `scroll_home`/`scroll_end`, which move a row cursor nowhere and
scroll the table sideways when it is wider than the screen (and do nothing when it is not). Operators expect
Home and End, like vi's g and G, to put the cursor on the first and last row: here they do, in every table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

from textual.binding import Binding, BindingType
from textual.widgets import DataTable
from textual.widgets.data_table import RowDoesNotExist

__all__ = ["ConsoleTable"]

CellType = TypeVar("CellType")


class ConsoleTable(DataTable[CellType], Generic[CellType]):
    """A DataTable with the console's table keys; a table widget of the console derives from it (or is one).

    Args:
        *args: DataTable's arguments.
        enter: what Enter does on a row, for the key map (`"Follow its log"`); None leaves Enter silent in the
            key map (it still selects the row, as DataTable's does).
        **kwargs: DataTable's keyword arguments.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "", show=False),
        Binding("up,k", "cursor_up", "Up", show=False),
        Binding("down,j", "cursor_down", "Down", show=False),
        Binding("left", "cursor_left", "Scroll left", show=False),
        Binding("right", "cursor_right", "Scroll right", show=False),
        Binding("pageup", "page_up", "Page up", show=False),
        Binding("pagedown", "page_down", "Page down", show=False),
        # DataTable's scroll_top/scroll_bottom move a row cursor to the first/last row, or scroll a table
        # without one; its Ctrl+Home/Ctrl+End are kept.
        Binding("home,g,ctrl+home", "scroll_top", "First row", show=False),
        Binding("end,G,ctrl+end", "scroll_bottom", "Last row", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | up, k | The row above. |
    | down, j | The row below. |
    | left, right | Scroll sideways (a table wider than the screen). |
    | pageup, pagedown | A page up or down. |
    | home, g, ctrl+home | The first row. |
    | end, G, ctrl+end | The last row. |
    | enter | Choose the row (what it does is the owner's: `enter=` names it). |
    """

    def __init__(self, *args: Any, enter: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if enter is not None:
            # Per instance: the same class serves tables whose Enter means different things.
            self._bindings.key_to_bindings["enter"] = [Binding("enter", "select_cursor", enter, show=False)]

    @property
    def highlighted_key(self) -> str | None:
        """The key of the row under the cursor, if a row is shown."""
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except RowDoesNotExist:
            return None

    def show_rows(self, rows: Sequence[tuple[str, Sequence[CellType]]]) -> None:
        """Show `rows` (key and cells, in order): rebuilt when the keys or their order changed, otherwise updated
        cell by cell, so the cursor and the scroll position stay where the operator left them."""
        if [key for key, _ in rows] != [row.value for row in self.rows]:
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
            return
        for key, cells in rows:
            for column, cell in zip(self.columns, cells, strict=True):
                self.update_cell(key, column, cell)

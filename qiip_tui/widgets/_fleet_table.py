"""The fleet table: one row per node, updated cell by cell as the fleet changes.

A fleet of a thousand nodes changing ten times a second must not rebuild the table: `sync(delta)` adds,
removes and rewrites only the rows the `FleetDelta` names, and within a row only the cells whose text
changed, then re-sorts once if a changed cell belongs to the sort column. Rebuilding is kept for what the
operator does (a new filter, problems only); a resize or a cell that outgrows its column only re-lays out.

Rendering follows the same idea: `VersionedTable` re-renders only the rows whose version `sync` bumped.

Columns are as wide as their content, the last error taking what is left, and the node column stays fixed while the
others scroll sideways on a narrow terminal (`qiip_tui.widgets._fleet_layout`).

Space marks rows (`✓` before the node's id) for the screen's actions on several nodes at once; a mark stays
through filters and sorts, and goes with its node when the node leaves the fleet.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Resize
from textual.message import Message
from textual.theme import Theme
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from qiip_core.client import NodeInfo
from qiip_tui._fleet import FLEET_COLUMNS, Fleet, FleetDelta, matches
from qiip_tui._fleet_cells import COLUMN_KEYS, ERROR_CELL, RowCells, same_cell
from qiip_tui._render import Palette
from qiip_tui.widgets._console_table import ConsoleTable
from qiip_tui.widgets._fleet_layout import column_widths, header, id_cell, scroll_stop, shown_scroll, sort_key
from qiip_tui.widgets._versioned_table import VersionedTable

__all__ = ["FleetTable"]


class FleetTable(ConsoleTable[Text], VersionedTable):
    """The nodes of a `Fleet`, filtered and sorted.

    Args:
        fleet: the fleet to show; the owner calls `sync()` after changing it.
    """

    DEFAULT_CSS = """
    FleetTable {
        height: 1fr;
    }
    FleetTable.-stale {
        tint: $background 45%;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Open", tooltip="Open the highlighted node"),
        Binding("s", "next_sort", "Sort", tooltip="Sort by the next column"),
        Binding("S", "reverse_sort", "Reverse", tooltip="Reverse the sort direction"),
        Binding("space", "toggle_mark", "Mark", tooltip="Mark or unmark the highlighted node, then move down"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Open the highlighted node. |
    | s | Sort by the next column. |
    | S | Reverse the sort direction. |
    | space | Mark or unmark the highlighted node (for drain, undrain, remove of all marked), then move down. |
    """

    class NodeHighlighted(Message):
        """The cursor moved to another node (or the table emptied).

        Posted by `FleetTable` when its row cursor moves. Handled by `on_fleet_table_node_highlighted`.
        """

        def __init__(self, node_id: str | None) -> None:
            super().__init__()
            self.node_id = node_id
            """The node under the cursor; None when no row is shown."""

    class Changed(Message):
        """The operator changed the sort or the marks (the filter is the screen's own field).

        Posted by `FleetTable.sort_by` and `FleetTable.toggle_mark`. Handled by `on_fleet_table_changed`.
        """

        def __init__(self, table: FleetTable) -> None:
            super().__init__()
            self.table = table
            """The table, with its `sort_column`, `sort_reverse` and `marked`."""

    class NodeChosen(Message):
        """The operator chose a node (Enter, or a click on the highlighted row).

        Posted by `FleetTable`. Handled by `on_fleet_table_node_chosen`.
        """

        def __init__(self, node_id: str) -> None:
            super().__init__()
            self.node_id = node_id
            """The node chosen."""

    def __init__(self, fleet: Fleet, *, now: Callable[[], datetime] | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self.fixed_columns = 1
        self.fleet = fleet
        self.now = now or (lambda: datetime.now(UTC))
        """The wall clock the errors' ages are measured against."""
        self.filter_text = ""
        """The filter (a substring of id, model, status or engine); empty shows every node."""
        self.problems_only = False
        """Whether only the nodes that need attention are shown (`Fleet.is_problem`)."""
        self.sort_column = "status"
        """The key of the column the rows are sorted by: by default the status, problems first."""
        self.sort_reverse = False
        """Whether the sort is descending."""
        self.marked: set[str] = set()
        """The nodes marked with Space, by id."""
        self._widths: tuple[int, ...] = ()
        self._cells: dict[str, list[Text]] = {}
        self._row_cells = RowCells()

    def on_mount(self) -> None:
        self._row_cells.palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)
        self._rebuild()

    def _theme_changed(self, theme: Theme) -> None:
        self._row_cells.palette = Palette.from_variables(self.app.theme_variables)
        self._row_cells.forget()
        self.sync(FleetDelta(changed=frozenset(self._cells)))

    def on_resize(self, event: Resize) -> None:
        if self._layout(event.size.width) != self._widths:
            self._apply_widths()

    def _layout(self, width: int) -> tuple[int, ...]:
        return column_widths(self._cells.values(), width)

    def _apply_widths(self) -> None:
        """Give the columns the widths their content needs now (no rebuild: DataTable re-lays out)."""
        widths = self._layout(self.size.width or self.app.size.width)
        if widths == self._widths:
            return
        self._widths = widths
        for key, width in zip(COLUMN_KEYS, widths, strict=True):
            column = self.columns[ColumnKey(key)]
            column.width, column.auto_width = width, False
        self.forget_rendered()
        for node_id in self._cells:
            self.bump_row(node_id)
        self._require_update_dimensions = True
        self.refresh()

    def set_stale(self, stale: bool) -> None:
        """Dim the table while its data may be out of date (the daemon cannot be reached)."""
        self.set_class(stale, "-stale")

    @property
    def highlighted_node(self) -> str | None:
        """The id of the node under the cursor, if a row is shown."""
        return self.highlighted_key

    def _render_row(self, node: NodeInfo, now: datetime, old: list[Text] | None = None) -> list[Text]:
        cells = self._row_cells.render(node, self.fleet.rates.nodes.get(node.id), now, old)
        if (node.id in self.marked) != (cells[0].plain != node.id):
            cells = [id_cell(node.id, marked=node.id in self.marked), *cells[1:]]
        return cells

    def toggle_mark(self, node_id: str) -> None:
        """Mark `node_id`, or unmark it when it is marked."""
        if node_id in self.marked:
            self.marked.discard(node_id)
        elif node_id in self.fleet.nodes:
            self.marked.add(node_id)
        else:
            return
        cells = self._cells.get(node_id)
        if cells is not None:
            cells[0] = id_cell(node_id, marked=node_id in self.marked)
            self.write_cell(node_id, COLUMN_KEYS[0], cells[0])
            self.bump_row(node_id, (0,))
            self._apply_widths()
            self.refresh()
        self.post_message(self.Changed(self))

    def clear_marks(self) -> None:
        """Unmark every node."""
        for node_id in sorted(self.marked):
            self.toggle_mark(node_id)

    def action_toggle_mark(self) -> None:
        """Mark or unmark the highlighted node, then move to the next row."""
        node_id = self.highlighted_node
        if node_id is None:
            return
        self.toggle_mark(node_id)
        self.action_cursor_down()

    def _shown(self, node: NodeInfo) -> bool:
        return matches(node, self.filter_text) and (not self.problems_only or self.fleet.is_problem(node))

    @property
    def shown_count(self) -> int:
        """Rows shown after the filter and the problems-only switch."""
        return len(self._cells)

    def _header(self, index: int) -> Text:
        return header(index, self.sort_column, self.sort_reverse)

    def _rebuild(self) -> None:
        """Build the columns and rows from scratch (after a filter change)."""
        highlighted = self.highlighted_node
        self.clear(columns=True)
        self._cells.clear()
        self._row_cells.forget()
        self.forget_rendered()
        now = self.now()
        shown = [node for node in self.fleet.nodes.values() if self._shown(node)]
        for node in shown:
            self._cells[node.id] = self._render_row(node, now)
        self._widths = self._layout(self.size.width or self.app.size.width)
        for index, (column, width) in enumerate(zip(FLEET_COLUMNS, self._widths, strict=True)):
            self.add_column(self._header(index), width=width, key=column.key)
        for node in shown:
            self.bump_row(node.id)
            self.add_row(*self._cells[node.id], key=node.id)
        self._sort(highlighted)

    def _add(self, node: NodeInfo, now: datetime) -> None:
        cells = self._render_row(node, now)
        self._cells[node.id] = cells
        self.bump_row(node.id)
        self.add_row(*cells, key=node.id)

    def _remove(self, node_id: str) -> None:
        if node_id not in self.fleet.nodes and node_id in self.marked:
            self.marked.discard(node_id)  # it left the fleet
            self.post_message(self.Changed(self))
        self._row_cells.forget(node_id)
        if self._cells.pop(node_id, None) is not None:
            self.remove_row(node_id)

    def sync(self, delta: FleetDelta | None = None) -> None:
        """Show the fleet's changes; without a delta, rebuild.

        Args:
            delta: the nodes that changed since the last call.
        """
        if delta is None:
            self._rebuild()
            return
        for node_id in delta.removed:
            self._remove(node_id)
        self._apply(delta.changed)

    def _apply(self, changed: frozenset[str]) -> None:
        """Rewrite the rows of `changed`, then re-size the columns and re-sort when their cells say so."""
        highlighted = self.highlighted_node
        resort = False
        sort_index = COLUMN_KEYS.index(self.sort_column)
        now = self.now()
        grown = False
        for node_id in changed:
            node = self.fleet.nodes.get(node_id)
            if node is None or not self._shown(node):
                self._remove(node_id)
                continue
            old = self._cells.get(node_id)
            if old is None:
                self._add(node, now)
                resort = True
                grown = True
                continue
            moved, wider = self._rewrite(node, old, self._render_row(node, now, old), sort_index)
            resort, grown = resort or moved, grown or wider
        if grown:
            self._apply_widths()
        if resort:
            self._sort(highlighted)
        self.refresh()

    def _rewrite(self, node: NodeInfo, old: list[Text], new: list[Text], sort_index: int) -> tuple[bool, bool]:
        """Update the cells of a row that changed.

        Returns:
            Whether the rows must be re-sorted (its sort cell changed), and whether a cell outgrew its column.
        """
        changed: list[int] = []
        wider = False
        widths = self._widths
        last = len(COLUMN_KEYS) - 1
        for index, (key, before, after) in enumerate(zip(COLUMN_KEYS, old, new, strict=True)):
            if before is after:
                continue
            if same_cell(before, after):
                # Keep the cell the table holds, so `_cells` are the table's own objects (`_sort` relies on it).
                new[index] = before
                continue
            changed.append(index)
            self.write_cell(node.id, key, after)
            wider = wider or (index < last and after.cell_len > widths[index])
        if changed:
            self.bump_row(node.id, changed)
        self._cells[node.id] = new
        # The status column sorts on rates too: any change may move the row.
        return bool(changed) and (sort_index == 1 or sort_index in changed), wider

    def refresh_ages(self) -> None:
        """Re-render the last-error cells, whose age grows with time (the owner calls it on each metrics poll)."""
        for node_id in self._row_cells.aged(self._cells, self.fleet.nodes, self.now()):
            self.write_cell(node_id, COLUMN_KEYS[-1], self._cells[node_id][ERROR_CELL])
            self.bump_row(node_id, (ERROR_CELL,))
        self.refresh()

    def _sort(self, keep: str | None) -> None:
        self.sort("id", key=sort_key(self._cells, self.fleet, self.sort_column), reverse=self.sort_reverse)
        if keep is not None and keep in self._cells:
            row = self.get_row_index(keep)
            if row != self.cursor_row:
                self.move_cursor(row=row, animate=False)

    def set_filter(self, text: str) -> None:
        """Show only the nodes whose id, model, status or engine contains `text` (case-insensitive)."""
        if text != self.filter_text:
            self.filter_text = text
            self._rebuild()

    def set_problems_only(self, on: bool) -> None:
        """Show only the nodes that need attention (`Fleet.is_problem`), or every node again."""
        if on != self.problems_only:
            self.problems_only = on
            self._rebuild()

    def sort_by(self, column: str, *, reverse: bool | None = None) -> None:
        """Sort by the column `column` (a key of `FLEET_COLUMNS`); the same column again flips the direction.

        Raises:
            ValueError: no such column.
        """
        if column not in COLUMN_KEYS:
            raise ValueError(f"There is no fleet column {column!r}; the columns are {', '.join(COLUMN_KEYS)}.")
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column, self.sort_reverse = column, reverse
        for index, key in enumerate(COLUMN_KEYS):
            self.columns[ColumnKey(key)].label = self._header(index)
        self._sort(self.highlighted_node)
        self._show_column(COLUMN_KEYS.index(column))
        self.post_message(self.Changed(self))

    def _show_column(self, index: int) -> None:
        """Scroll sideways so column `index` (and its sort marker) is on screen."""
        if index < self.fixed_columns:
            return
        widths = [column.get_render_width(self) for column in self.ordered_columns]
        fixed = sum(widths[: self.fixed_columns])
        left = sum(widths[self.fixed_columns : index])
        target = shown_scroll(left, widths[index], self.scroll_x, self.scrollable_content_region.width - fixed)
        if target is not None:
            self.scroll_to(x=min(target, self.max_scroll_x), animate=False)

    def action_next_sort(self) -> None:
        """Sort by the column right of the current one (wrapping), ascending."""
        self.sort_by(COLUMN_KEYS[(COLUMN_KEYS.index(self.sort_column) + 1) % len(COLUMN_KEYS)], reverse=False)

    def action_reverse_sort(self) -> None:
        """Flip the sort direction."""
        self.sort_by(self.sort_column, reverse=not self.sort_reverse)

    def action_cursor_right(self) -> None:
        """Scroll sideways to the next column (the node column stays)."""
        self._scroll_columns(1)

    def action_cursor_left(self) -> None:
        """Scroll sideways to the previous column."""
        self._scroll_columns(-1)

    def _scroll_columns(self, step: int) -> None:
        widths = [column.get_render_width(self) for column in self.ordered_columns[self.fixed_columns :]]
        target = scroll_stop(widths, round(self.scroll_x), step)
        self.scroll_to(x=min(target, self.max_scroll_x), animate=False)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        if event.column_key.value is not None:
            self.sort_by(event.column_key.value)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self.post_message(self.NodeHighlighted(event.row_key.value))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        node_id = event.row_key.value
        if node_id is not None:
            self.post_message(self.NodeChosen(node_id))

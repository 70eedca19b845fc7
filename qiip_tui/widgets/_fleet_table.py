"""The fleet table: one row per node, updated cell by cell as the fleet changes.

A fleet of a thousand nodes changing ten times a second must not rebuild the table: `sync(delta)` adds,
removes and rewrites only the rows the `FleetDelta` names, and within a row only the cells whose text
changed, then re-sorts once if a changed cell belongs to the sort column. Rebuilding is kept for what the
operator does (a new filter, a resize that changes the column widths).

Rendering follows the same idea: `VersionedTable` re-renders only the rows whose version `sync` bumped.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Resize
from textual.message import Message
from textual.theme import Theme
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey, RowDoesNotExist, RowKey

from qiip_core.client import NodeInfo
from qiip_tui._fleet import FLEET_COLUMNS, Fleet, FleetDelta, gpu_totals, matches
from qiip_tui._render import DASH, Palette, breaker_text, engine_text, gpu_text, status_text, ttft_text
from qiip_tui.widgets._versioned_table import VersionedTable

__all__ = ["FleetTable"]

_COMPACT_BELOW = 120
"""Terminal widths below this use the columns' compact widths."""

_KEYS = [column.key for column in FLEET_COLUMNS]


class FleetTable(VersionedTable):
    """The nodes of a `Fleet`, filtered and sorted.

    Args:
        fleet: the fleet to show; the owner calls `sync()` after changing it.
    """

    DEFAULT_CSS = """
    FleetTable {
        height: 1fr;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Open", tooltip="Open the highlighted node"),
        Binding("s", "next_sort", "Sort", tooltip="Sort by the next column"),
        Binding("S", "reverse_sort", "Reverse", tooltip="Reverse the sort direction"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Open the highlighted node. |
    | s | Sort by the next column. |
    | S | Reverse the sort direction. |
    """

    class NodeHighlighted(Message):
        """The cursor moved to another node (or the table emptied).

        Posted by `FleetTable` when its row cursor moves. Handled by `on_fleet_table_node_highlighted`.
        """

        def __init__(self, node_id: str | None) -> None:
            super().__init__()
            self.node_id = node_id
            """The node under the cursor; None when no row is shown."""

    class NodeChosen(Message):
        """The operator chose a node (Enter, or a click on the highlighted row).

        Posted by `FleetTable`. Handled by `on_fleet_table_node_chosen`.
        """

        def __init__(self, node_id: str) -> None:
            super().__init__()
            self.node_id = node_id
            """The node chosen."""

    def __init__(self, fleet: Fleet, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.fleet = fleet
        self.filter_text = ""
        """The filter (a substring of id, model, status or engine); empty shows every node."""
        self.sort_column = "id"
        """The key of the column the rows are sorted by."""
        self.sort_reverse = False
        """Whether the sort is descending."""
        self._palette = Palette()
        self._widths: tuple[int, ...] = ()
        self._cells: dict[str, list[Text]] = {}

    # -- life --------------------------------------------------------------------------------------------

    def on_mount(self) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)
        self._rebuild()

    def _theme_changed(self, theme: Theme) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.sync(FleetDelta(changed=frozenset(self._cells)))

    def on_resize(self, event: Resize) -> None:
        if self._layout(event.size.width) != self._widths:
            self._rebuild()

    def _layout(self, width: int) -> tuple[int, ...]:
        compact = width < _COMPACT_BELOW
        widths = [c.compact_width if compact else c.width for c in FLEET_COLUMNS]
        # Each column has one cell of padding on each side; the scrollbar takes two more.
        spare = width - sum(widths[:-1]) - 2 * len(widths) - 2
        widths[-1] = max(widths[-1], spare)
        return tuple(widths)

    # -- contents ----------------------------------------------------------------------------------------

    @property
    def highlighted_node(self) -> str | None:
        """The id of the node under the cursor, if a row is shown."""
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except RowDoesNotExist:
            return None

    def _render_row(self, node: NodeInfo) -> list[Text]:
        widths = self._widths or tuple(column.width for column in FLEET_COLUMNS)
        return [
            Text(node.id),
            status_text(node.status, self._palette),
            engine_text(node.engine, widths[_KEYS.index("engine")]),
            Text(node.model),
            Text(str(node.in_flight), justify="right"),
            breaker_text(node.breaker.state, self._palette),
            gpu_text(widths[_KEYS.index("gpu")], self._palette, gpu_totals(node)),
            ttft_text(self.fleet.ttft_p50_s.get(node.id)),
            Text(node.last_error.splitlines()[0] if node.last_error else DASH),
        ]

    def _header(self, index: int) -> Text:
        column = FLEET_COLUMNS[index]
        if column.key != self.sort_column:
            return Text(column.label)
        return Text(f"{column.label} {'▼' if self.sort_reverse else '▲'}", style="bold")

    def _rebuild(self) -> None:
        """Build the columns and rows from scratch (after a filter or layout change)."""
        highlighted = self.highlighted_node
        self._widths = self._layout(self.size.width or self.app.size.width)
        self.clear(columns=True)
        self._cells.clear()
        self.forget_rendered()
        for index, (column, width) in enumerate(zip(FLEET_COLUMNS, self._widths, strict=True)):
            self.add_column(self._header(index), width=width, key=column.key)
        for node in self.fleet.nodes.values():
            if matches(node, self.filter_text):
                self._add(node)
        self._sort(highlighted)

    def _add(self, node: NodeInfo) -> None:
        cells = self._render_row(node)
        self._cells[node.id] = cells
        self.bump_row(node.id)
        self.add_row(*cells, key=node.id)

    def _remove(self, node_id: str) -> None:
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
        highlighted = self.highlighted_node
        resort = False
        sort_index = _KEYS.index(self.sort_column)
        for node_id in delta.removed:
            self._remove(node_id)
        for node_id in delta.changed:
            node = self.fleet.nodes.get(node_id)
            if node is None or not matches(node, self.filter_text):
                self._remove(node_id)
                continue
            old = self._cells.get(node_id)
            if old is None:
                self._add(node)
                resort = True
                continue
            new = self._render_row(node)
            if new != old:
                self.bump_row(node_id)
            for key, before, after in zip(_KEYS, old, new, strict=True):
                if before != after:
                    self.update_cell(node_id, key, after)
            resort = resort or old[sort_index] != new[sort_index]
            self._cells[node_id] = new
        if resort:
            self._sort(highlighted)

    def _sort(self, keep: str | None) -> None:
        fleet, column = self.fleet, FLEET_COLUMNS[_KEYS.index(self.sort_column)]

        def key(cell: Any) -> Any:
            node = fleet.nodes[str(cell)]
            return (column.sort_key(node, fleet), node.id)

        self.sort("id", key=key, reverse=self.sort_reverse)
        if keep is not None and keep in self._cells:
            row = self.get_row_index(keep)
            if row != self.cursor_row:
                self.move_cursor(row=row, animate=False)

    def set_filter(self, text: str) -> None:
        """Show only the nodes whose id, model, status or engine contains `text` (case-insensitive)."""
        if text != self.filter_text:
            self.filter_text = text
            self._rebuild()

    def sort_by(self, column: str, *, reverse: bool | None = None) -> None:
        """Sort by the column `column` (a key of `FLEET_COLUMNS`); the same column again flips the direction.

        Raises:
            ValueError: no such column.
        """
        if column not in _KEYS:
            raise ValueError(f"There is no fleet column {column!r}; the columns are {', '.join(_KEYS)}.")
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column, self.sort_reverse = column, reverse
        for index, key in enumerate(_KEYS):
            self.columns[ColumnKey(key)].label = self._header(index)
        self._sort(self.highlighted_node)

    # -- input -------------------------------------------------------------------------------------------

    def action_next_sort(self) -> None:
        """Sort by the column right of the current one (wrapping), ascending."""
        self.sort_by(_KEYS[(_KEYS.index(self.sort_column) + 1) % len(_KEYS)], reverse=False)

    def action_reverse_sort(self) -> None:
        """Flip the sort direction."""
        self.sort_by(self.sort_column, reverse=not self.sort_reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        if event.column_key.value is not None:
            self.sort_by(event.column_key.value)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        self.post_message(self.NodeHighlighted(_value(event.row_key)))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        node_id = _value(event.row_key)
        if node_id is not None:
            self.post_message(self.NodeChosen(node_id))


def _value(key: RowKey) -> str | None:
    return key.value

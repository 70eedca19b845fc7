"""The fleet table's geometry, without a terminal: how wide each column is, and where sideways scrolling stops.

Columns are as wide as their content (between each column's minimum and maximum, with room for the sort marker in
the header), the last one (the last error) taking what is left. The node column stays fixed while the others
scroll, one column per ← or →.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich.text import Text

from qiip_tui._fleet import FLEET_COLUMNS, Fleet
from qiip_tui._fleet_cells import COLUMN_KEYS

__all__ = ["SORT_MARKER_CELLS", "column_widths", "header", "id_cell", "scroll_stop", "shown_scroll", "sort_key"]

SORT_MARKER_CELLS = 2
"""Room every header keeps for ` ▲`, so the marker is never cut."""


def column_widths(rows: Iterable[Sequence[Text]], width: int) -> tuple[int, ...]:
    """Each column's width for `rows` (one cell per `FLEET_COLUMNS` column) within `width` cells."""
    rows = list(rows)
    widths = []
    for index, column in enumerate(FLEET_COLUMNS[:-1]):
        content = max((cells[index].cell_len for cells in rows), default=0)
        widths.append(min(max(content, len(column.label) + SORT_MARKER_CELLS, column.min_width), column.max_width))
    last = FLEET_COLUMNS[-1]
    # Each column has one cell of padding on each side; the scrollbar takes two more.
    spare = width - sum(widths) - 2 * len(FLEET_COLUMNS) - 2
    widths.append(max(last.min_width, spare))
    return tuple(widths)


def header(index: int, sort_column: str, reverse: bool) -> Text:
    """Column `index`'s header: its label, with `▲` or `▼` on the sort column."""
    column = FLEET_COLUMNS[index]
    if column.key != sort_column:
        return Text(column.label)
    return Text(f"{column.label} {'▼' if reverse else '▲'}", style="bold")


def id_cell(node_id: str, *, marked: bool) -> Text:
    """The node column's cell: the id, after `✓` and reversed when the row is marked (Space)."""
    return Text(f"✓ {node_id}", style="bold reverse") if marked else Text(node_id)


def sort_key(rows: Mapping[str, Sequence[Text]], fleet: Fleet, column: str) -> Callable[[Any], Any]:
    """The key `DataTable.sort` calls with each row's id cell: the column's sort value of its node, then its id.

    Args:
        rows: the cells of each row shown, by node id (the id cells the table holds).
        fleet: the fleet the rows show.
        column: the key of the sort column.
    """
    by_column = FLEET_COLUMNS[COLUMN_KEYS.index(column)]
    # DataTable hands the key the id cells; finding their node by the cell object is cheaper than by its text.
    by_cell = {id(cells[0]): node_id for node_id, cells in rows.items()}

    def key(cell: Any) -> Any:
        node = fleet.nodes[by_cell[id(cell)]]
        return (by_column.sort_key(node, fleet), node.id)

    return key


def scroll_stop(widths: Sequence[int], current: int, step: int) -> int:
    """The scroll offset of the next column edge right (`step` > 0) or left of `current`.

    Args:
        widths: the rendered widths of the scrolling columns (the fixed ones left out), in order.
        current: the horizontal scroll offset now.
        step: +1 or -1.
    """
    edges, x = [0], 0
    for width in widths[:-1]:
        x += width
        edges.append(x)
    if step > 0:
        return next((edge for edge in edges if edge > current), edges[-1])
    return next((edge for edge in reversed(edges) if edge < current), 0)


def shown_scroll(left: int, width: int, scroll_x: float, visible: int) -> int | None:
    """The scroll offset that shows a column starting `left` cells into the scrolling part, `width` wide, or None
    when it is on screen already at `scroll_x` with `visible` cells shown."""
    if left < scroll_x or left + width > scroll_x + visible:
        return left
    return None

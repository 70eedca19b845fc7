"""A DataTable that re-renders only the rows that changed.

DataTable keys its rendered cells and lines on a counter that every update bumps, so one changed cell re-renders
every visible line: at 160×48 some 45 lines and 400 cells, over 20 ms, ten times a second for a busy fleet. This
table keeps its own caches keyed on each row's and each cell's version, which its owner bumps (`bump_row`) when
it changes a row or some of its cells, and moves a cached line to its new position after a sort by rewriting the
row index DataTable keeps in the segments' metadata (its mouse handling reads it).

It leans on DataTable internals of the Textual series pyproject.toml allows (`_render_cell`, `_render_line`,
`_get_offsets`, `_row_locations`, `_data` and `_update_count` for `write_cell`); the console's snapshot and
behaviour tests exercise them. Rows must be one line high and the cursor a row cursor; anything else renders as
DataTable does.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.cache import LRUCache
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey, RowKey

__all__ = ["VersionedTable"]


class VersionedTable(DataTable[Text]):
    """A DataTable of single-line rows, keyed by string, that caches rendering per row version."""

    def __init__(self, *, id: str | None = None, cell_padding: int = 1) -> None:
        super().__init__(id=id, cursor_type="row", cell_padding=cell_padding)
        self._row_versions: dict[str, int] = {}
        self._row_base: dict[str, int] = {}
        self._cell_versions: dict[tuple[str, int], int] = {}
        self._version = 0
        self._rendered: LRUCache[tuple[Any, ...], tuple[int, list[list[Segment]]]] = LRUCache(4096)
        self._lines: LRUCache[tuple[Any, ...], tuple[int, Strip]] = LRUCache(1024)
        self._frame_style: Style | None = None

    def bump_row(self, key: str, columns: Iterable[int] | None = None) -> None:
        """Say that row `key` changed (or is new): its cached rendering is stale.

        Args:
            key: the row.
            columns: the indexes of the cells that changed; None for all of them. The row's other cells are
                reused from the cache (a metrics poll changes four cells of every row, not the GPU meter).
        """
        self._version += 1
        self._row_versions[key] = self._version
        if columns is None:
            self._row_base[key] = self._version
        else:
            for column in columns:
                self._cell_versions[(key, column)] = self._version

    def write_cell(self, row_key: str, column_key: str, value: Text) -> None:
        """Replace a cell's value without a repaint; the owner calls `refresh()` once after a batch of writes.

        `DataTable.update_cell` repaints the widget for each cell, which a poll that rewrites a thousand rows
        cannot afford. The row and column must exist.
        """
        self._data[RowKey(row_key)][ColumnKey(column_key)] = value
        self._update_count += 1

    def forget_rendered(self) -> None:
        """Drop every cached rendering (after the columns or the whole table changed)."""
        self._row_versions.clear()
        self._row_base.clear()
        self._cell_versions.clear()
        self._rendered.clear()
        self._lines.clear()

    @property
    def rich_style(self) -> Style:
        # DataTable asks for it once per line, and it walks the ancestors each time; it cannot change mid-frame.
        return self._frame_style if self._frame_style is not None else super().rich_style

    def render_lines(self, crop: Region) -> list[Strip]:
        self._frame_style = super().rich_style
        try:
            return super().render_lines(crop)
        finally:
            self._frame_style = None

    def _render_cell(
        self,
        row_index: int,
        column_index: int,
        base_style: Style,
        width: int,
        cursor: bool = False,
        hover: bool = False,
    ) -> list[list[Segment]]:
        if row_index < 0 or column_index < 0:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        node_id = row_key.value if row_key is not None else None
        if node_id is None or node_id not in self._row_versions:
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        version = max(self._row_base.get(node_id, 0), self._cell_versions.get((node_id, column_index), 0))
        key = (
            node_id,
            column_index,
            version,
            base_style,
            width,
            cursor,
            hover,
            self._show_hover_cursor,
            self._pseudo_class_state,
        )
        cached = self._rendered.get(key)
        if cached is None:
            lines = super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
            self._rendered[key] = (row_index, lines)
            return lines
        rendered_at, lines = cached
        if rendered_at == row_index:
            return lines
        meta = _meta(row_index, column_index)
        moved = [[Segment(seg.text, (seg.style or Style()) + meta, seg.control) for seg in line] for line in lines]
        self._rendered[key] = (row_index, moved)
        return moved

    def _render_line(self, y: int, x1: int, x2: int, base_style: Style) -> Strip:
        if self.cursor_type != "row":
            return super()._render_line(y, x1, x2, base_style)
        try:
            row_key, offset = self._get_offsets(y)
        except LookupError:
            return super()._render_line(y, x1, x2, base_style)
        node_id = row_key.value
        version = self._row_versions.get(node_id) if node_id is not None else None
        row_index = self._row_locations.get(row_key)
        if version is None or row_index is None:
            return super()._render_line(y, x1, x2, base_style)
        key = (
            node_id,
            version,
            offset,
            x1,
            x2,
            self.size.width,
            self.cursor_coordinate.row == row_index,
            self.hover_coordinate.row == row_index,
            base_style,
            self._show_hover_cursor,
            self._pseudo_class_state,
        )
        cached = self._lines.get(key)
        if cached is None:
            strip = super()._render_line(y, x1, x2, base_style)
            self._lines[key] = (row_index, strip)
            return strip
        rendered_at, strip = cached
        if rendered_at != row_index:
            segments = [
                Segment(seg.text, seg.style + _meta(row_index, _column(seg.style)), seg.control)
                if seg.style is not None and _column(seg.style) is not None
                else seg
                for seg in strip
            ]
            strip = Strip(segments, strip.cell_length)
            self._lines[key] = (row_index, strip)
        return strip


@lru_cache(maxsize=65536)
def _meta(row: int, column: int | None) -> Style:
    # One Style object per position: Styles with meta compare by identity, so sharing them keeps Rich's caches warm.
    return Style.from_meta({"row": row, "column": column})


@lru_cache(maxsize=4096)
def _column(style: Style) -> int | None:
    column = style.meta.get("column")
    return column if isinstance(column, int) else None

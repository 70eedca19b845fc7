"""Requests in flight shared by the daemon's serving processes (`server.workers`): one board in shared memory.

With several workers behind one port, each process reserves nodes for its own requests, yet least-connections,
a node's concurrency cap, admission's bound and a drain must count every process's requests. The board is a
file mapped into every process (`mmap`, under `/dev/shm` where it exists): one 64-bit count per node and
process, the node's column holding one cell per process, side by side.

Each process writes only its own cells (its count for a node, after every reservation and release), so no
lock is needed and no update is lost: a reader sums the column. An aligned 8-byte store is a single write on
the 64-bit machines the daemon runs on, so a reader sees a cell's old value or its new one, never a torn one.
Choosing and reserving are one step in each process but not across them: processes choosing at the same instant
may each take a node's last free place, so a concurrency cap or an admission bound can be passed by at most one
request per other process, for as long as those requests run.

Columns are assigned by the primary process (`ColumnMap`) and reach the workers with the fleet; a freed column
is reused last (first in, first out), long after every process has dropped the node it held.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from pathlib import Path

__all__ = ["DEFAULT_COLUMNS", "ColumnMap", "InFlightBoard"]

DEFAULT_COLUMNS = 4096
"""Nodes the board holds at once (a node past it is counted by each process alone, and logged)."""

_CELL_BYTES = 8


class InFlightBoard:
    """Requests in flight per node, over every serving process.

    Open it with `create` (the primary) or `open` (a worker); close it with `close`.

    Args:
        path: the board's file.
        rows: the serving processes (the primary is row 0, worker `n` row `n`).
        columns: the nodes it can hold.
        row: this process's row.

    Raises:
        OSError: the file cannot be opened or mapped.
        ValueError: the file's size is not `rows × columns` cells, or `row` is out of range.
    """

    def __init__(self, path: Path, *, rows: int, columns: int, row: int) -> None:
        if not 0 <= row < rows:
            raise ValueError(f"row {row} is not one of the board's {rows}")
        size = rows * columns * _CELL_BYTES
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, not {rows} × {columns} cells")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._cells = memoryview(self._map).cast("q")
        self.path = path
        self.rows = rows
        self.columns = columns
        self.row = row

    @classmethod
    def create(cls, path: Path, *, rows: int, columns: int = DEFAULT_COLUMNS) -> InFlightBoard:
        """Create the board's file (mode 0600, every count 0) and open it as row 0.

        Raises:
            OSError: the file exists or cannot be written.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, rows * columns * _CELL_BYTES)
        finally:
            os.close(fd)
        return cls(path, rows=rows, columns=columns, row=0)

    def total(self, column: int) -> int:
        """Requests in flight on the node of `column`, over every process."""
        start = column * self.rows
        return sum(self._cells[start : start + self.rows])

    def put(self, column: int, count: int) -> None:
        """Set this process's count for the node of `column`."""
        self._cells[column * self.rows + self.row] = count

    def row_total(self, row: int) -> int:
        """Requests in flight that process `row` counts, over every node."""
        return sum(self._cells[row :: self.rows])

    def clear_row(self, row: int) -> None:
        """Zero every count of process `row` (one that exited: its requests ended with it)."""
        for column in range(self.columns):
            self._cells[column * self.rows + row] = 0

    def close(self) -> None:
        """Unmap the board (the file stays; the primary removes it)."""
        self._cells.release()
        self._map.close()


class ColumnMap:
    """The primary's assignment of board columns to node ids.

    Args:
        columns: the board's columns.
    """

    def __init__(self, columns: int = DEFAULT_COLUMNS) -> None:
        self._by_node: dict[str, int] = {}
        self._free: deque[int] = deque(range(columns))

    def get(self, node_id: str) -> int | None:
        """The node's column, or None."""
        return self._by_node.get(node_id)

    def assign(self, node_id: str) -> int | None:
        """The node's column, assigning the free one released longest ago; None when the board is full."""
        column = self._by_node.get(node_id)
        if column is None and self._free:
            column = self._by_node[node_id] = self._free.popleft()
        return column

    def release(self, node_id: str) -> int | None:
        """Free the node's column (it goes to the back of the queue); returns it, or None."""
        column = self._by_node.pop(node_id, None)
        if column is not None:
            self._free.append(column)
        return column

"""The in-flight board (`server.workers`): two routing tables on one board, as the primary and a worker hold them,
count each other's reservations: least-connections, concurrency caps and admission see every process's requests,
and a node deleted from the registry leaves once the last process's request ends."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiip_core import ModelOverloaded, ModelUnavailable
from qiip_core.config import AdmissionSettings
from qiip_core.nodes import Node, NodeCapabilities
from qiip_core.routing import Admission, ColumnMap, InFlightBoard, RoutingTable


def node(node_id: str, **caps: object) -> Node:
    return Node(
        id=node_id,
        endpoint=f"http://127.0.0.1:{9000 + len(node_id)}",
        model="m",
        status="healthy",
        capabilities=NodeCapabilities(**caps),
    )


@pytest.fixture
def boards(tmp_path: Path) -> Iterator[tuple[InFlightBoard, InFlightBoard]]:
    primary = InFlightBoard.create(tmp_path / "board", rows=2, columns=8)
    worker = InFlightBoard(tmp_path / "board", rows=2, columns=8, row=1)
    yield primary, worker
    worker.close()
    primary.close()


def tables(boards: tuple[InFlightBoard, InFlightBoard], *nodes: Node) -> tuple[RoutingTable, RoutingTable]:
    """The primary's table (assigning columns) and a worker's (taking them), both holding `nodes`."""
    primary = RoutingTable(board=boards[0], columns=ColumnMap(8), rng=random.Random(1))
    worker = RoutingTable(board=boards[1], rng=random.Random(2))
    for n in nodes:
        primary.apply_put(n, source="test")
        worker.apply_put(n, source="test")
        worker.set_column(n.id, primary.column(n.id))
    return primary, worker


def test_a_process_writes_its_own_cell_and_a_column_sums_every_process(
    boards: tuple[InFlightBoard, InFlightBoard],
) -> None:
    primary, worker = boards
    primary.put(3, 2)
    worker.put(3, 5)
    assert primary.total(3) == worker.total(3) == 7
    primary.clear_row(1)
    assert primary.total(3) == worker.total(3) == 2


def test_a_board_file_of_another_shape_is_refused(tmp_path: Path) -> None:
    InFlightBoard.create(tmp_path / "board", rows=2, columns=8).close()
    with pytest.raises(ValueError, match="not 3 × 8 cells"):
        InFlightBoard(tmp_path / "board", rows=3, columns=8, row=1)
    with pytest.raises(ValueError, match="row 2 is not one of the board's 2"):
        InFlightBoard(tmp_path / "board", rows=2, columns=8, row=2)
    with pytest.raises(FileExistsError):
        InFlightBoard.create(tmp_path / "board", rows=2, columns=8)


def test_a_freed_column_is_reused_last() -> None:
    columns = ColumnMap(3)
    assert [columns.assign(n) for n in "abc"] == [0, 1, 2]
    assert columns.assign("d") is None
    assert columns.release("a") == 0
    assert columns.assign("a") == 0
    assert columns.release("b") == 1 and columns.release("c") == 2
    assert columns.assign("e") == 1


def test_least_connections_counts_the_other_process_reservations(
    boards: tuple[InFlightBoard, InFlightBoard],
) -> None:
    primary, worker = tables(boards, node("a"), node("b"))
    held = [primary.reserve("m") for _ in range(2)]
    assert {r.node.id for r in held} == {"a", "b"}
    third = primary.reserve("m")
    # The worker sees the primary's three: it sends its own to the node with one.
    lone = next(n for n in ("a", "b") if n != third.node.id)
    assert worker.reserve("m").node.id == lone
    third.release()
    state = worker.get(lone)
    # Two on the node over both processes; one of them is the worker's own (its row of the board).
    assert state is not None and state.in_flight == 2
    assert worker.board is not None and worker.board.row_total(1) == 1


def test_a_concurrency_cap_and_admission_hold_over_every_process(
    boards: tuple[InFlightBoard, InFlightBoard],
) -> None:
    primary, worker = tables(boards, node("a", concurrency=2))
    primary.reserve("m")
    worker.reserve("m")
    with pytest.raises(ModelUnavailable):
        worker.reserve("m")
    admission = Admission(worker, AdmissionSettings(max_in_flight=2))
    with pytest.raises(ModelOverloaded, match="2 requests are in flight"):
        admission.admit("m")


def test_a_deleted_node_leaves_once_the_last_process_request_ends(
    boards: tuple[InFlightBoard, InFlightBoard],
) -> None:
    primary, worker = tables(boards, node("a"))
    held = worker.reserve("m")
    primary.apply_delete("a")
    primary.sweep()
    state = primary.get("a")
    assert state is not None and state.status.value == "draining" and state.in_flight == 1
    held.release()
    primary.sweep()
    assert "a" not in primary
    # Its column is free again, and back at the end of the queue.
    primary.apply_put(node("c"), source="test")
    assert primary.column("c") != 0

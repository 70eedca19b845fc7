"""Small things an operator notices: cut text ends in an ellipsis, histories keep their time axis, a CPU node's
memory is called RAM, counts agree with their nouns, and a node the daemon will not remove is not offered."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.console import Console
from textual.pilot import Pilot

from qiip_tui import QiipConsole
from qiip_tui._fleet_cells import COLUMN_KEYS, RowCells
from qiip_tui._render import Palette, error_text, plural
from qiip_tui.screens import ConfirmModal, FleetScreen
from qiip_tui.widgets import FleetTable, NodeHeader
from qiip_tui.widgets._history_sparkline import drawn_columns
from tests.tui.conftest import screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import SAMPLE_METRICS, node, sample_fleet

NOW = datetime(2026, 11, 29, 12, 5, tzinfo=UTC)


def test_a_cut_error_ends_in_an_ellipsis() -> None:
    text = error_text("GET /health: Cannot connect to host gpu04.lab:8000", NOW, NOW, current=True, palette=Palette())
    console = Console(width=80, color_system=None)
    # As the fleet table renders a cell: its column's width, one line.
    (line,) = console.render_lines(text, console.options.update_dimensions(24, 1))
    assert "".join(segment.text for segment in line) == "now · GET /health: Cann…"


def test_a_history_keeps_its_time_axis_whatever_it_holds() -> None:
    # Four samples after a restart take 4/60 of the width, at the right; sixty take all of it.
    assert drawn_columns(150, 4, 60) == 10 and drawn_columns(150, 60, 60) == 150 and drawn_columns(150, 90, 60) == 150
    assert drawn_columns(150, 0, 60) == 0 and drawn_columns(10, 1, 60) == 1


def test_a_cpu_nodes_memory_says_ram_and_counts_agree_with_their_nouns() -> None:
    cells = RowCells()
    by_id = {n.id: n for n in sample_fleet()}
    memory = COLUMN_KEYS.index("gpu")
    assert "RAM" in cells.render(by_id["cpu01"], None, NOW)[memory].plain
    assert "RAM" not in cells.render(by_id["gpu01"], None, NOW)[memory].plain
    assert (plural(1, "failure"), plural(3, "failure"), plural(0, "probe")) == ("1 failure", "3 failures", "0 probes")


async def test_a_config_file_node_is_not_offered_for_removal_and_its_header_counts_right() -> None:
    declared = node("gpu09", source="config", managed=False, breaker={"state": "open", "consecutive_failures": 1})
    client = FakeClient([*sample_fleet(), declared], metrics=SAMPLE_METRICS)
    app = QiipConsole(client=client, clock=lambda: 1000.0, metrics_interval_s=3600, node_poll_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        await wait_for(pilot, lambda: screen.query_one(FleetTable).row_count == 9, what="the fleet")
        app.node_action("remove", "gpu09")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmModal)
        (note,) = [n for n in app._notifications if n.title == "Remove gpu09"]
        assert "declared in the daemon's config file ([[nodes]])" in note.message and "delete it there" in note.message
        app.node_action("remove", "cpu01")  # a local node: removed, it comes back at the next start
        modal = await screen_of(pilot, ConfirmModal)
        assert "It comes back when the daemon next starts: it is declared in [[local_nodes]]" in modal.body
        await pilot.press("n")
        app.open_node("gpu09")
        header = await wait_header(pilot, app)
        assert "breaker open (1 failure)" in header


async def wait_header(pilot: Pilot[None], app: QiipConsole) -> str:
    await wait_for(pilot, lambda: bool(app.screen.query(NodeHeader)), what="the node screen")
    widget = app.screen.query_one(NodeHeader)
    await pilot.pause()
    return str(widget.render())

"""Marking fleet rows to act on several nodes at once, and each screen's sort and filter remembered between runs."""

from __future__ import annotations

import json
from pathlib import Path

from textual.widgets import Input

from qiip_tui import QiipConsole
from qiip_tui.screens import ConfirmModal, FleetScreen, LogsScreen
from qiip_tui.widgets import FleetSummary, FleetTable, LogView
from tests.tui.conftest import screen_of, wait_for
from tests.tui.fakes import FakeClient, FakeLogsClient
from tests.tui.samples import SAMPLE_METRICS, sample_fleet


def _console(client: FakeClient | None = None) -> QiipConsole:
    client = client or FakeClient(sample_fleet(), metrics=SAMPLE_METRICS)
    return QiipConsole(client=client, clock=lambda: 1000.0, metrics_interval_s=3600, node_poll_s=3600)


async def test_space_marks_rows_and_drain_acts_on_all_marked_after_one_confirmation_listing_them() -> None:
    app = _console()
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        table.sort_by("id", reverse=False)
        table.move_cursor(row=table.get_row_index("gpu01"))
        await pilot.press("space", "space", "down", "space")  # gpu01, gpu02, then gpu04 (gpu03 skipped)
        assert table.marked == {"gpu01", "gpu02", "gpu04"}
        assert str(table.get_cell("gpu02", "id")) == "✓ gpu02" and str(table.get_cell("gpu03", "id")) == "gpu03"
        assert "3 marked" in str(screen.query_one(FleetSummary).render())
        await pilot.press("space")  # the cursor is on gpu05 now: marked too, then unmarked again
        table.move_cursor(row=table.get_row_index("gpu05"))
        await pilot.press("space")
        assert table.marked == {"gpu01", "gpu02", "gpu04"}

        await pilot.press("D")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Drain 3 nodes?"
        assert [line.split()[0] for line in modal.body.splitlines()[:3]] == ["gpu01", "gpu02", "gpu04"]
        await pilot.press("n")  # cancelled: nothing happens, the marks stay
        await screen_of(pilot, FleetScreen)
        assert table.marked == {"gpu01", "gpu02", "gpu04"} and not app.operations

        await pilot.press("D")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await wait_for(pilot, lambda: len(app.operations) == 3, what="three drains")
        assert sorted(op.node_id for op in app.operations.values()) == ["gpu01", "gpu02", "gpu04"]
        assert table.marked == set() and str(table.get_cell("gpu01", "id")) == "gpu01"

        # Other actions act on the highlighted node only; Esc unmarks.
        await pilot.press("space")
        assert table.marked
        await pilot.press("escape")
        assert table.marked == set()


async def test_a_model_left_without_a_healthy_node_is_named_in_the_confirmation() -> None:
    app = _console()
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        table.toggle_mark("gpu01")
        table.toggle_mark("gpu02")
        table.toggle_mark("cpu01")
        await pilot.press("x")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Remove 3 nodes?"
        assert "No healthy node would be left for Qwen/Qwen3-8B, tiny-chat" in modal.body


async def test_the_fleets_sort_filter_and_problems_only_and_each_log_search_come_back_on_the_next_start(
    config_home: Path,
) -> None:
    app = _console()
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        await pilot.press("s", "S", "slash", *"gpu", "enter", "e")
        assert (table.sort_column, table.sort_reverse, table.filter_text, table.problems_only) == (
            "model",
            True,
            "gpu",
            True,
        )
        state = config_home / "qiip" / "console-state.json"
        await wait_for(pilot, lambda: state.exists() and '"problems_only": true' in state.read_text(), what="the state")
    written = json.loads(state.read_text())
    assert written["views"]["fleet"] == {"sort": "model", "reverse": True, "filter": "gpu", "problems_only": True}

    app = _console(FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.filter_text == "gpu" and table.row_count == 3, what="the filter")
        assert (table.sort_column, table.sort_reverse, table.problems_only) == ("model", True, True)
        assert screen.query_one("#filter", Input).value == "gpu"
        await pilot.press("l")
        logs = await screen_of(pilot, LogsScreen)
        await pilot.press("slash", *"breaker")
        timeline = logs.query_one("#timeline-view", LogView)
        await wait_for(pilot, lambda: timeline.search_text == "breaker", what="the search")
        await wait_for(pilot, lambda: "breaker" in state.read_text(), what="the search remembered")

    app = _console(FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(160, 40)) as pilot:
        await screen_of(pilot, FleetScreen)
        await pilot.press("l")
        logs = await screen_of(pilot, LogsScreen)
        timeline = logs.query_one("#timeline-view", LogView)
        assert timeline.search_text == "breaker"
        await wait_for(pilot, lambda: len(timeline.records) > 0, what="the journal")

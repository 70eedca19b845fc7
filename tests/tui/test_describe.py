"""A node's recent errors on its screen, and the describe view (`d`): everything about it as text, copied with `y`."""

from __future__ import annotations

from datetime import UTC, datetime

from textual.widgets import Static

from qiip_tui import QiipConsole
from qiip_tui._describe import describe_node
from qiip_tui.screens import DescribeScreen, FleetScreen, NodeScreen
from qiip_tui.widgets import FleetTable
from tests.tui.conftest import screen_of, wait_for
from tests.tui.fakes import FakeLogsClient
from tests.tui.samples import SAMPLE_METRICS, ollama_node, sample_fleet

NOW = datetime(2026, 11, 29, 12, 5, tzinfo=UTC)


def test_a_description_has_the_state_every_error_with_its_count_the_events_and_the_record() -> None:
    gpu04 = next(n for n in sample_fleet() if n.id == "gpu04")
    text = describe_node(gpu04, now=NOW, events=None)
    assert "Breaker:      open (5 consecutive failures)" in text
    errors = text[text.index("Recent errors") :].splitlines()
    assert errors[0] == "Recent errors (2, newest first):"
    assert errors[1] == (
        "  2026-11-29 12:02:00 UTC (3m ago) ×4, first 2026-11-29 12:01:10 UTC  connect failed: connection refused"
    )
    assert errors[2] == "  2026-11-29 11:58:30 UTC (6m ago)  the node answered HTTP 503."
    assert "Events: this daemon keeps no journal" in text
    assert text.splitlines()[-1] == "}" and '"recent_errors": [' in text  # the whole record, as JSON


def test_an_ollama_nodes_description_says_whether_its_model_is_loaded() -> None:
    lines = describe_node(ollama_node(), now=NOW, events=None).splitlines()
    assert "Loaded:       qwen2.5:14b  10.0 GiB, 7.0 GiB in GPU memory, context 4096" in lines
    assert "Engine:       ollama" in lines
    unloaded = ollama_node().model_copy(update={"resident": []})
    assert "Loaded:       none" in describe_node(unloaded, now=NOW, events=None).splitlines()
    assert not any(
        line.startswith("Loaded:") for line in describe_node(sample_fleet()[0], now=NOW, events=None).splitlines()
    )


async def test_d_describes_the_highlighted_node_with_its_journal_and_y_copies_it() -> None:
    client = FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS)
    app = QiipConsole(client=client, wall_clock=lambda: NOW, metrics_interval_s=3600, node_poll_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        fleet = await screen_of(pilot, FleetScreen)
        table = fleet.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        table.move_cursor(row=table.get_row_index("gpu02"))
        await pilot.press("d")
        view = await screen_of(pilot, DescribeScreen)
        assert view.node_id == "gpu02"
        await wait_for(pilot, lambda: "breaker open" in view.text, what="the journal's events")
        assert "healthy → unhealthy — 1 failed health probe" in view.text
        assert "gpu01" not in view.text.split("Record")[0]  # only its own events
        await pilot.press("y")
        assert app.clipboard == view.text
        assert str(view.query_one("#describe-text", Static).render()).startswith("Name:         gpu02")
        await pilot.press("escape")
        await screen_of(pilot, FleetScreen)

        # The node screen lists the daemon's record of its errors, with their counts.
        app.open_node("gpu04")
        node = await screen_of(pilot, NodeScreen)
        shown = str(node.query_one("#errors", Static).render())
        assert shown.splitlines()[:2] == [
            "12:02:00 (3m ago) ×4 connect failed: connection refused",
            "11:58:30 (6m ago) the node answered HTTP 503.",
        ]
        await pilot.press("d")
        assert (await screen_of(pilot, DescribeScreen)).node_id == "gpu04"

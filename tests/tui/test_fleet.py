"""The fleet and node screens against a real daemon with real llama.cpp nodes: filter, sort, drain, undrain."""

from __future__ import annotations

import pytest
from textual.coordinate import Coordinate

from qiip_tui import QiipConsole
from qiip_tui._commands import console_commands
from qiip_tui.screens import ChatScreen, ConfirmModal, FleetScreen, HelpScreen, LogsScreen, NodeScreen
from qiip_tui.widgets import FleetTable, NodeHeader
from tests.support.daemon import Daemon
from tests.tui.conftest import config_for, screen_of, wait_for

pytestmark = pytest.mark.integration


def rows(app: QiipConsole) -> list[str]:
    table = app.screen.query_one(FleetTable)
    return [str(table.get_cell_at(Coordinate(row, 0))) for row in range(table.row_count)]


async def test_filter_and_sort(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: len(rows(app)) == 3, what="the three nodes")
        assert rows(app) == ["chat-a", "chat-b", "slow"]

        await pilot.press("slash", *"CHAT-B")
        await wait_for(pilot, lambda: rows(app) == ["chat-b"], what="the filter")
        await pilot.press("enter")
        assert rows(app) == ["chat-b"], "the filter stays after Enter"
        await pilot.press("escape")
        assert rows(app) == ["chat-a", "chat-b", "slow"]
        await pilot.press("slash", *"slow-m", "enter")
        assert rows(app) == ["slow"], "models match too"
        await pilot.press("escape")

        # A click on the Model header sorts by model; a second click reverses.
        table = app.screen.query_one(FleetTable)
        model_x = sum(width + 2 for width in table._widths[:2]) + 1
        await pilot.click(FleetTable, offset=(model_x, 0))
        assert table.sort_column == "model" and rows(app) == ["slow", "chat-a", "chat-b"]
        await pilot.click(FleetTable, offset=(model_x, 0))
        assert table.sort_reverse and rows(app) == ["chat-b", "chat-a", "slow"]
        # `s` moves the sort to the next column (the request rate), `S` reverses it.
        await pilot.press("s")
        assert table.sort_column == "rps" and not table.sort_reverse
        await pilot.press("S")
        assert table.sort_reverse


async def test_drain_from_the_node_screen_after_confirming(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon), operation_poll_s=0.1)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "chat-b" in rows(app), what="chat-b")
        await pilot.press("down", "enter")
        await screen_of(pilot, NodeScreen)
        screen = app.screen
        assert isinstance(screen, NodeScreen) and screen.node_id == "chat-b" and app.selection.node == "chat-b"

        await pilot.press("D")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("n")
        await pilot.pause(0.3)
        assert app.fleet.nodes["chat-b"].status == "healthy", "cancelled: nothing happens"

        await pilot.click("#drain")
        await screen_of(pilot, ConfirmModal)
        await pilot.click("#confirm")
        await wait_for(pilot, lambda: app.fleet.nodes["chat-b"].status == "draining", what="chat-b to drain")
        header = app.screen.query_one(NodeHeader)
        await wait_for(pilot, lambda: "draining" in str(header.render()), what="the header to say draining")
        await wait_for(
            pilot,
            lambda: any(op.kind == "drain" and op.state == "succeeded" for op in app.operations.values()),
            what="the drain operation to succeed",
        )
        assert console_daemon.node_statuses()["chat-b"] == "draining"

        # A drain's registry update carries no heartbeat: the header keeps the last contact, and the peak counts
        # the requests in flight now.
        text = str(header.render())
        assert "seen —" not in text and " UTC" in text.split("seen ")[1]
        in_flight = str(app.screen.query_one("#in-flight-label").render())
        now, peak = (int(part.split()[0]) for part in in_flight.removeprefix("In flight: ").split(" now, peak "))
        assert peak >= now

        await pilot.press("u")
        await wait_for(pilot, lambda: app.fleet.nodes["chat-b"].status == "healthy", what="chat-b to undrain")
        await wait_for(pilot, lambda: "healthy" in str(header.render()), what="the header to say healthy")
        assert "seen —" not in str(header.render())
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)
        assert str(app.screen.query_one(FleetTable).get_cell("chat-b", "status")) == "healthy"


async def test_keyboard_first_palette_key_map_and_screen_keys(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: len(rows(app)) == 3, what="the nodes")
        await pilot.press("down")
        await wait_for(pilot, lambda: app.selection.node == "chat-b", what="chat-b selected")

        titles = [c.title for c in app.get_system_commands(app.screen)]
        titles += [c.name for c in console_commands(app)]
        assert titles.count("Keys") == 1 and "Theme" in titles and "Drain node chat-b" in titles

        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Drain node", "enter")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Drain chat-b?"
        await pilot.press("question_mark")
        keys = await screen_of(pilot, HelpScreen)
        assert keys.title_text == "confirmation" and ("y", "Confirm", "this screen") in keys.rows
        assert ("esc / n", "Cancel", "this screen") in keys.rows
        await pilot.press("escape")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("escape")

        await pilot.press("question_mark")
        keys = await screen_of(pilot, HelpScreen)
        assert keys.title_text == "fleet"
        for row in [
            ("/", "Filter", "this screen"),
            ("d", "Describe", "this screen"),
            ("D", "Drain", "this screen"),
            ("s", "Sort", "this table"),
            ("⏎", "Open", "this table"),
            ("↓ / j", "Down", "this table"),
            ("home / ^home / g", "First row", "this table"),
            ("end / ^end / G", "Last row", "this table"),
            ("pgdn", "Page down", "this table"),
            (":", "Command", "everywhere"),
            ("tab", "Next field or table", "this screen"),
        ]:
            assert row in keys.rows, keys.rows
        assert not any("Table" in where or "Screen" in where for _, _, where in keys.rows), keys.rows
        assert ("c", "Chat", "everywhere") in keys.rows and ("?", "Keys", "everywhere") in keys.rows
        await pilot.press("escape")

        await pilot.press("c")
        await screen_of(pilot, ChatScreen)
        await pilot.press("escape")
        await screen_of(pilot, FleetScreen)
        await pilot.press("l")
        await screen_of(pilot, LogsScreen)
        await pilot.press("f")
        await screen_of(pilot, FleetScreen)
        await pilot.press("enter")
        await screen_of(pilot, NodeScreen)
        await pilot.press("question_mark")
        keys = await screen_of(pilot, HelpScreen)
        assert any(action == "Back" and "q" in key.split(" / ") for key, action, _ in keys.rows), keys.rows
        await pilot.press("escape")
        await screen_of(pilot, NodeScreen)
        await pilot.press("f")
        await screen_of(pilot, FleetScreen)

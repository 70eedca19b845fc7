"""The logs screen against a real daemon with real llama.cpp nodes: the fleet's timeline and engine logs."""

from __future__ import annotations

import asyncio

import pytest
from textual.widgets import RichLog, Static, TabbedContent

from qiip_tui import QiipConsole
from qiip_tui.screens import ConfirmModal, LogsScreen, NodeScreen
from qiip_tui.widgets import LogView
from tests.support.daemon import Daemon
from tests.tui.conftest import config_for, screen_of, wait_for

pytestmark = pytest.mark.integration


async def test_the_timeline_shows_history_and_a_drain_from_the_console_live(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon), operation_poll_s=0.1)
    async with app.run_test(size=(140, 36)) as pilot:
        await wait_for(pilot, lambda: "slow" in app.fleet.nodes, what="the fleet")
        await pilot.press("l")
        screen = await screen_of(pilot, LogsScreen)
        view = screen.query_one("#timeline-view", LogView)
        # Events from before the console connected: the nodes joining and turning healthy.
        await wait_for(pilot, lambda: any(r.source == "chat-a" and r.tag == "added" for r in view.records))
        assert any(r.source == "chat-a" and "→ healthy — health probe ok" in r.message for r in view.records)

        app.node_action("drain", "slow")
        await screen_of(pilot, ConfirmModal)
        await pilot.press("y")
        await screen_of(pilot, LogsScreen)

        def drained() -> list[str]:
            return [r.message for r in view.records if r.source == "slow" and "→ draining" in r.message]

        await wait_for(pilot, drained, what="the drain in the timeline")
        (line,) = drained()
        assert line.startswith("healthy → draining — drain operation op_")
        change = next(r for r in view.records if r.source == "slow" and "→ draining" in r.message)
        assert change.at is not None and change.at.utcoffset() is not None
        await wait_for(pilot, lambda: any(r.source == "slow" and r.tag == "op succeeded" for r in view.records))

        await asyncio.to_thread(console_daemon.admin.post, "/admin/nodes/slow/undrain", json={})
        await wait_for(pilot, lambda: any(r.source == "slow" and "draining → " in r.message for r in view.records))

        view.query_one(RichLog).focus()
        await pilot.press("slash", *"drain operation")
        await wait_for(pilot, lambda: view.search_text == "drain operation")
        assert len(view.query_one(RichLog).lines) == sum(1 for r in view.records if "drain operation" in r.message)
        assert len(view.query_one(RichLog).lines) >= 1
        await pilot.press("escape")


def _llama_server_line(message: str) -> bool:
    # The tail may hold only request lines once other tests have used the node: `srv …` and `slot …` lines.
    return any(word in message for word in ("llama", "srv ", "slot "))


async def test_l_on_a_node_screen_follows_that_nodes_engine_log(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(140, 36)) as pilot:
        await wait_for(pilot, lambda: "chat-a" in app.fleet.nodes, what="the fleet")
        app.push_screen(NodeScreen("chat-a"))
        await screen_of(pilot, NodeScreen)
        await pilot.press("l")
        screen = await screen_of(pilot, LogsScreen)
        assert screen.query_one("#logs-panes", TabbedContent).active == "engine"
        assert screen.engine_node == "chat-a"
        view = screen.query_one("#engine-log", LogView)
        await wait_for(
            pilot, lambda: any(_llama_server_line(r.message) for r in view.records), what="llama-server lines"
        )

        # A node the daemon did not launch has no engine log here, and the screen says why.
        screen.follow_engine_log("slow")
        title = screen.query_one("#engine-title", Static)
        await wait_for(pilot, lambda: "not kept by this daemon" in str(title.render()), what="the refusal")
        assert "slow" in str(title.render())

        # Back on the fleet, another node's screen: `l` shows that node's log on the screen already open.
        await pilot.press("f")
        app.push_screen(NodeScreen("chat-b"))
        await screen_of(pilot, NodeScreen)
        await pilot.press("l")
        screen = await screen_of(pilot, LogsScreen)
        await wait_for(pilot, lambda: screen.engine_node == "chat-b", what="chat-b's log")
        await wait_for(pilot, lambda: screen.query_one("#logs-panes", TabbedContent).active == "engine")
        view = screen.query_one("#engine-log", LogView)
        await wait_for(pilot, lambda: any(_llama_server_line(r.message) for r in view.records), what="chat-b's lines")

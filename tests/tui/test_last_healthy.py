"""Confirmations warn before draining, removing or relaunching the last healthy node of a model."""

from __future__ import annotations

import pytest
from textual.widgets import Static

from qiip_tui import QiipConsole
from qiip_tui.screens import ConfirmModal, SizingScreen
from tests.support.daemon import Daemon
from tests.tui.conftest import config_for, screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import sample_fleet

LAST_SLOW = (
    "slow is the last healthy node of slow-model: clients of that model will get 503 until another node serves it."
)


def body_of(modal: ConfirmModal) -> str:
    return str(modal.query_one("#body", Static).render())


@pytest.mark.integration
async def test_drain_and_remove_warn_for_a_model_with_one_node_only(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(
            pilot,
            lambda: all(
                app.fleet.nodes.get(n) and app.fleet.nodes[n].status == "healthy" for n in ("slow", "chat-a", "chat-b")
            ),
            timeout_s=30,
            what="the fleet",
        )
        # slow-model has one node: its drain and its removal say what clients will see.
        for action in ("drain", "remove"):
            app.node_action(action, "slow")
            modal = await screen_of(pilot, ConfirmModal)
            assert body_of(modal).endswith("\n\n" + LAST_SLOW)
            await pilot.press("n")
            await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmModal), what="the dialog to close")

        # tiny-chat has two healthy nodes: no warning, for a drain or a relaunch.
        app.node_action("drain", "chat-a")
        modal = await screen_of(pilot, ConfirmModal)
        assert "last healthy node" not in body_of(modal)
        await pilot.press("n")
        app.node_action("relaunch", "chat-a")
        await screen_of(pilot, SizingScreen)
        await pilot.press("ctrl+s")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Relaunch chat-a?" and "last healthy node" not in body_of(modal)
        await pilot.press("n")
    assert console_daemon.node_statuses()["slow"] == "healthy"


async def test_relaunch_warns_for_the_last_healthy_node() -> None:
    # cpu01 is the only node of tiny-chat in the sample fleet.
    app = QiipConsole(client=FakeClient(sample_fleet()), metrics_interval_s=3600, node_poll_s=3600)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: "cpu01" in app.fleet.nodes, what="the fleet")
        app.node_action("relaunch", "cpu01")
        await screen_of(pilot, SizingScreen)
        await pilot.press("ctrl+s")
        modal = await screen_of(pilot, ConfirmModal)
        assert body_of(modal).endswith(
            "cpu01 is the last healthy node of tiny-chat: clients of that model will get 503 until another node "
            "serves it."
        )

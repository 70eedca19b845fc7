"""Keys the console answers everywhere: the table keys, the `:` command line, the footer, and the key map."""

from __future__ import annotations

from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, RichLog
from textual.widgets._footer import FooterKey

from qiip_tui import QiipConsole
from qiip_tui._command_line import Command, CommandError, complete, parse
from qiip_tui.screens import (
    ChatScreen,
    CommandLine,
    ConfirmModal,
    FleetScreen,
    HelpScreen,
    LogsScreen,
    ModelsScreen,
    NodeScreen,
)
from qiip_tui.widgets import ConsoleTable, FleetTable, LogView
from tests.support.daemon import Daemon
from tests.tui.conftest import burst, config_for, screen_of, wait_for
from tests.tui.fakes import FakeLogsClient, FakeModelsClient, FakeProvisioningClient
from tests.tui.samples import SAMPLE_METRICS, sample_fleet
from tests.tui.test_fleet import rows

NODES = ["chat-a", "chat-b", "slow"]
MODELS = ["slow-model", "tiny-chat"]

# -- the command language, without a terminal --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("drain chat-a", Command("drain", "chat-a")),
        (":undrain chat-b", Command("undrain", "chat-b")),
        ("  node slow ", Command("node", "slow")),
        ("model tiny-chat", Command("model", "tiny-chat")),
        ("q", Command("quit")),
        ("models", Command("models")),
    ],
)
def test_a_command_line_is_read_and_checked(text: str, command: Command) -> None:
    assert parse(text, nodes=NODES, models=MODELS) == command


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("drain gpu-9", "No node named gpu-9; 3 nodes: chat-a, chat-b, slow."),
        ("drain chat-aa", "No node named chat-aa (did you mean chat-a?); 3 nodes: chat-a, chat-b, slow."),
        ("model llama", "No node serves a model named llama; 2 models: slow-model, tiny-chat."),
        ("drian chat-a", "No command named drian (did you mean drain?); the commands are drain, undrain, "),
        ("drain", "drain takes one node: drain NODE (got none; 3 nodes: chat-a, chat-b, slow)."),
        ("node chat-a chat-b", "node takes one node: node NODE (got chat-a chat-b; 3 nodes: "),
        ("fleet now", "fleet takes no argument; got now."),
        ("", "Type a command, e.g. drain NODE; the commands are drain, "),
    ],
)
def test_a_wrong_command_line_gets_one_line_naming_the_thing_and_the_reason(text: str, message: str) -> None:
    with pytest.raises(CommandError) as caught:
        parse(text, nodes=NODES, models=MODELS)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_names_are_listed_up_to_five() -> None:
    nodes = [f"gpu{index:02}" for index in range(12)]
    with pytest.raises(
        CommandError, match=r"^No node named gpu-9 .*; 12 nodes: gpu00, gpu01, gpu02, gpu03, gpu04 and 7 more\.$"
    ):
        parse("drain gpu-9", nodes=nodes, models=[])


def test_tab_completes_commands_then_nodes_and_models() -> None:
    assert complete("dr", nodes=NODES, models=MODELS).text == "drain "
    assert complete("flee", nodes=NODES, models=MODELS).text == "fleet"
    many = complete("m", nodes=NODES, models=MODELS)
    assert many.text == "model" and many.candidates == ("model", "models")
    assert complete("drain ch", nodes=NODES, models=MODELS).text == "drain chat-"
    assert complete("drain chat-", nodes=NODES, models=MODELS).candidates == ("chat-a", "chat-b")
    assert complete("drain s", nodes=NODES, models=MODELS).text == "drain slow"
    assert complete("model T", nodes=NODES, models=MODELS).text == "model tiny-chat"
    assert complete("fleet x", nodes=NODES, models=MODELS).candidates == ()


# -- against a real daemon ---------------------------------------------------------------------------------


async def command(pilot: Pilot[Any], text: str) -> CommandLine:
    await pilot.press("colon")
    line = await screen_of(pilot, CommandLine)
    await pilot.press(*text)
    return line


@pytest.mark.integration
async def test_table_keys_move_the_cursor_first_last_and_by_one(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    # 160 columns: the table is narrower than the screen, where Home and End used to do nothing.
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: len(rows(app)) == 3, what="the nodes")
        table = app.screen.query_one(FleetTable)
        for key, row in [("j", 1), ("j", 2), ("k", 1), ("g", 0), ("G", 2), ("home", 0), ("end", 2), ("up", 1)]:
            await pilot.press(key)
            assert table.cursor_row == row, key
        assert table.scroll_x == 0
        await wait_for(pilot, lambda: app.selection.node == "chat-b", what="chat-b selected")


@pytest.mark.integration
async def test_the_command_line_acts_through_the_console_actions(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: len(rows(app)) == 3, what="the nodes")

        line = await command(pilot, "node chat-")
        await pilot.press("tab")
        assert line.field.value == "node chat-" and "chat-a chat-b" in str(line.query_one("#command-hint").render())
        await pilot.press("tab")
        assert line.field.value == "node chat-a"
        await pilot.press("tab")
        assert line.field.value == "node chat-b"
        await pilot.press("enter")
        node = await screen_of(pilot, NodeScreen)
        assert node.node_id == "chat-b"

        # A typo stays on the line with the reason under it.
        line = await command(pilot, "drain gpu-9")
        await pilot.press("enter")
        assert app.screen is line and line.field.value == "drain gpu-9"
        hint = str(line.query_one("#command-hint").render())
        assert hint == "No node named gpu-9; 3 nodes: chat-a, chat-b, slow."
        await pilot.press("escape")
        await screen_of(pilot, NodeScreen)

        # Drain still asks first.
        await command(pilot, "drain slow")
        await pilot.press("enter")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question == "Drain slow?"
        await pilot.press("escape")
        await screen_of(pilot, NodeScreen)

        await command(pilot, "model tiny-chat")
        await pilot.press("enter")
        fleet = await screen_of(pilot, FleetScreen)
        await wait_for(pilot, lambda: rows(app) == ["chat-a", "chat-b"], what="the model's nodes")
        assert fleet.query_one("#filter", Input).value == "tiny-chat"

        await command(pilot, "logs")
        await pilot.press("enter")
        await screen_of(pilot, LogsScreen)
        await command(pilot, "fleet")
        await pilot.press("enter")
        await screen_of(pilot, FleetScreen)


@pytest.mark.integration
async def test_a_colon_in_a_chat_message_is_text(console_daemon: Daemon) -> None:
    app = QiipConsole(config_for(console_daemon))
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_for(pilot, lambda: len(rows(app)) == 3, what="the nodes")
        await pilot.press("c")
        chat = await screen_of(pilot, ChatScreen)
        await pilot.press(*"note: q?")
        assert chat.query_one("#prompt", Input).value == "note: q?"
        assert app.screen is chat
        await pilot.press("tab")  # out of the prompt: `:` opens the line again
        await pilot.press("colon")
        await screen_of(pilot, CommandLine)
        await pilot.press(*"q", "enter")
        await wait_for(pilot, lambda: not app.is_running, what="the console to quit")


# -- with the canned fleet ---------------------------------------------------------------------------------


def canned(client: FakeModelsClient | FakeProvisioningClient) -> QiipConsole:
    return QiipConsole(client=client, clock=lambda: 1000.0, metrics_interval_s=3600, node_poll_s=3600)


def footer_keys(app: QiipConsole, width: int) -> set[str]:
    """The keys the footer shows in full within `width` columns."""
    return {key.key for key in app.screen.query(FooterKey) if key.region.width and key.region.right <= width}


async def test_question_mark_and_q_are_in_the_footer_at_80_columns() -> None:
    app = canned(FakeProvisioningClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(80, 24)) as pilot:
        await screen_of(pilot, FleetScreen)
        await wait_for(pilot, lambda: len(app.fleet.nodes) == 8, what="the fleet")
        for step in ["", "enter", "l", "m"]:
            if step:
                await pilot.press(step)
            await pilot.pause()
            await wait_for(pilot, lambda: {"q", "question_mark", "colon"} <= footer_keys(app, 80), what=step)
        await pilot.press("c")
        await screen_of(pilot, ChatScreen)
        # While the message field has the focus, `?` and `:` are text, and the footer does not offer them.
        await wait_for(pilot, lambda: "escape" in footer_keys(app, 80), what="the chat's keys")
        assert "question_mark" not in footer_keys(app, 80)
        await pilot.press("tab")
        await wait_for(pilot, lambda: {"question_mark", "colon"} <= footer_keys(app, 80), what="? out of the field")


async def test_every_table_has_the_same_keys_and_power_off_moved_to_capital_o() -> None:
    app = canned(FakeProvisioningClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(120, 36)) as pilot:
        await screen_of(pilot, FleetScreen)
        await pilot.press("l")
        logs = await screen_of(pilot, LogsScreen)
        await pilot.press("3")
        tasks = logs.query_one("#tasks", DataTable)
        await wait_for(pilot, lambda: tasks.row_count >= 2, what="the tasks")
        assert isinstance(tasks, ConsoleTable) and isinstance(logs.query_one("#engine-nodes"), ConsoleTable)
        tasks.focus()
        await pilot.pause()
        await pilot.press("j")
        assert tasks.cursor_row == 1
        await pilot.press("k")
        assert tasks.cursor_row == 0
        await pilot.press("G")
        assert tasks.cursor_row == tasks.row_count - 1
        await pilot.press("O")
        modal = await screen_of(pilot, ConfirmModal)
        assert modal.question.startswith("Power off")
        await pilot.press("escape")
        await pilot.press("question_mark")
        help_screen = await screen_of(pilot, HelpScreen)
        assert ("⏎", "Follow its log", "this table") in help_screen.rows
        assert ("↑ / k", "Up", "this table") in help_screen.rows

    app = canned(FakeModelsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(120, 36)) as pilot:
        await screen_of(pilot, FleetScreen)
        await pilot.press("m")
        models = await screen_of(pilot, ModelsScreen)
        table = models.query_one("#generations", DataTable)
        await wait_for(pilot, lambda: table.row_count >= 2, what="the catalog")
        assert isinstance(table, ConsoleTable)
        await pilot.press("end")
        assert table.cursor_row == table.row_count - 1
        await pilot.press("home")
        assert table.cursor_row == 0


async def test_the_palette_opens_the_command_line() -> None:
    app = canned(FakeModelsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(120, 36)) as pilot:
        await screen_of(pilot, FleetScreen)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"Command line")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await screen_of(pilot, CommandLine)


async def test_home_and_end_move_the_cursor_and_do_not_scroll_a_wide_table_sideways() -> None:
    app = canned(FakeModelsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(80, 24)) as pilot:
        await screen_of(pilot, FleetScreen)
        table = app.screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        assert table.max_scroll_x > 0, "at 80 columns the fleet table is wider than the screen"
        await pilot.press("end")
        assert (table.cursor_row, table.scroll_x) == (7, 0)
        await pilot.press("home")
        assert (table.cursor_row, table.scroll_x) == (0, 0)


async def test_keys_act_on_the_pane_shown_and_each_panes_key_map_lists_its_own() -> None:
    app = canned(FakeLogsClient(sample_fleet(), metrics=SAMPLE_METRICS))
    async with app.run_test(size=(120, 36)) as pilot:
        await screen_of(pilot, FleetScreen)
        await wait_for(pilot, lambda: len(app.fleet.nodes) == 8, what="the fleet")
        await pilot.press("l")
        logs = await screen_of(pilot, LogsScreen)
        # The engine pane, its first node's log, and a search typed in one burst: `s` is no setup here.
        await burst(pilot, "2", "enter", "slash", "s", "l", "o", "t")
        engine = logs.query_one("#engine-log", LogView)
        await wait_for(pilot, lambda: engine.search_text == "slot", what="the search")
        assert app.screen is logs and len(engine.query_one(RichLog).lines) == 1

        async def key_map() -> set[str]:
            await pilot.press("question_mark")
            shown = await screen_of(pilot, HelpScreen)
            await pilot.press("escape")
            await screen_of(pilot, LogsScreen)
            return {action for _, action, _ in shown.rows}

        await pilot.press("escape", "1")
        timeline = await key_map()
        assert "Set up" not in timeline and "Power off" not in timeline
        await pilot.press("s", "t")
        assert app.screen is logs  # the provisioning pane's keys do nothing on the timeline
        await pilot.press("3")
        provisioning = await key_map()
        assert {"Set up", "Cancel", "Tear down", "Power on", "Power off", "Restart"} <= provisioning
        assert {"Search the log", "Pause/follow"} <= provisioning  # the host log's, from its table

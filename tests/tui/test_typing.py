"""Every key typed into a text field of the console acts, in the order typed, at any speed: keys that arrive
together in one read of the terminal (a fast typist, key repeat, a slow link) are not lost or reordered."""

from __future__ import annotations

import ast
from pathlib import Path

from textual.app import App, ComposeResult
from textual.widgets import Input

import qiip_tui
from qiip_tui import QiipConsole
from qiip_tui.screens import CommandLine, FleetScreen, SizingScreen
from qiip_tui.widgets import ConsoleInput, FleetTable
from tests.tui.conftest import burst, screen_of, wait_for
from tests.tui.fakes import FakeClient
from tests.tui.samples import SAMPLE_METRICS, sample_fleet


class _Field(App[None]):
    def compose(self) -> ComposeResult:
        yield ConsoleInput(id="field")


async def test_backspace_and_the_next_key_in_one_read_both_act() -> None:
    app = _Field()
    async with app.run_test() as pilot:
        field = app.query_one(ConsoleInput)
        await burst(pilot, "a", "b", "c", "backspace", "d", "backspace", "backspace", "x")
        assert field.value == "ax"
        await burst(pilot, "left", "y", "home", "z", "end", "backspace", "w")
        assert field.value == "zayw"


def _console() -> QiipConsole:
    client = FakeClient(sample_fleet(), metrics=SAMPLE_METRICS)
    return QiipConsole(client=client, clock=lambda: 1000.0, metrics_interval_s=3600, node_poll_s=3600)


async def test_the_fleet_filter_the_command_line_and_the_sizing_editor_keep_every_key_of_a_burst() -> None:
    app = _console()
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        await pilot.press("slash")
        await burst(pilot, "g", "p", "u", "0", "2", "backspace", "1")
        assert screen.query_one("#filter", Input).value == "gpu01"
        assert table.row_count == 1 and table.filter_text == "gpu01"
        await pilot.press("escape")

        await pilot.press("colon")
        line = await screen_of(pilot, CommandLine)
        await burst(pilot, *"drian", "backspace", "backspace", "backspace", *"ain gpu02")
        assert line.field.value == "drain gpu02"
        await pilot.press("escape")

        app.node_action("relaunch", "gpu02")
        editor = await screen_of(pilot, SizingScreen)
        slots = editor.query_one("#slots", Input)
        slots.focus()
        await pilot.pause()
        await burst(pilot, "end", "backspace", "backspace", "backspace", "1", "6", "backspace", "2")
        assert slots.value == "12"
        assert editor.values.slots == "12"


async def test_keys_typed_after_one_that_moves_the_focus_go_where_the_focus_went() -> None:
    app = _console()
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await screen_of(pilot, FleetScreen)
        table = screen.query_one(FleetTable)
        await wait_for(pilot, lambda: table.row_count == 8, what="the fleet")
        # `p` and `u` are the fleet screen's power and undrain keys: typed right after `/`, they are the filter's.
        await burst(pilot, "slash", "g", "p", "u", "0", "3")
        assert screen.query_one("#filter", Input).value == "gpu03"
        assert len(app.screen_stack) == 1 and not app._notifications  # no power, no undrain
        await burst(pilot, "escape", "colon", "f", "l", "e", "e", "t")
        line = await screen_of(pilot, CommandLine)
        assert line.field.value == "fleet"


def test_every_text_field_of_the_console_is_a_console_input() -> None:
    plain: list[str] = []
    for path in Path(qiip_tui.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Input":
                plain.append(f"{path.name}:{node.lineno}")
    assert plain == []

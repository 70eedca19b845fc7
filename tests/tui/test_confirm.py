"""The confirmation dialog on its own: the keys decide, and the option is reachable from the keyboard."""

from __future__ import annotations

from textual.app import App

from qiip_tui.screens import ConfirmModal


class _Host(App[None]):
    def __init__(self) -> None:
        super().__init__()
        self.answers: list[bool | None] = []

    def ask(self, option: str | None) -> None:
        modal = ConfirmModal("Remove gpu01?", "It goes.", confirm="Remove", option=option)
        self.push_screen(modal, self.answers.append)


async def test_f_ticks_the_option_and_y_confirms_with_it() -> None:
    app = _Host()
    async with app.run_test(size=(80, 24)) as pilot:
        app.ask("Force: skip the drain")
        await pilot.pause()
        await pilot.press("f", "y")
        await pilot.pause()
        app.ask("Force: skip the drain")
        await pilot.pause()
        await pilot.press("f", "f", "y")
        await pilot.pause()
        app.ask(None)
        await pilot.pause()
        await pilot.press("f", "y")
        await pilot.pause()
        app.ask(None)
        await pilot.pause()
        await pilot.press("n")
        await pilot.pause()
    assert app.answers == [True, False, False, None]

"""The key bar rebuilds its keys when the keys it shows change, and only then."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Button
from textual.widgets._footer import FooterKey

from qiip_tui.widgets import KeyFooter


class _Host(App[None]):
    BINDINGS = [Binding("d", "drain", "Drain"), Binding("r", "remove", "Remove")]

    def __init__(self) -> None:
        super().__init__()
        self.draining = False

    def compose(self) -> ComposeResult:
        yield Button("one", id="one")
        yield Button("two", id="two")
        yield KeyFooter()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # While a drain runs, Remove is shown disabled (Textual's dynamic actions: None greys a key out).
        return None if action == "remove" and self.draining else True

    def action_drain(self) -> None:
        self.draining = True
        self.refresh_bindings()

    def action_remove(self) -> None:
        pass


def _keys(app: App[None]) -> list[FooterKey]:
    return list(app.screen.query_one(KeyFooter).query(FooterKey))


async def test_a_focus_move_keeps_the_keys_and_a_change_of_what_is_enabled_rebuilds_them() -> None:
    app = _Host()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        shown = _keys(app)
        assert [(key.key, key.description, key.has_class("-disabled")) for key in shown] == [
            ("d", "Drain", False),
            ("r", "Remove", False),
            ("ctrl+p", "palette", False),
        ]

        await pilot.press("tab")
        await pilot.press("tab")
        await pilot.pause()
        assert app.focused is not None and app.focused.id == "one"
        assert _keys(app) == shown  # the same widgets: nothing was rebuilt for a focus move

        await pilot.press("d")
        await pilot.pause()
        rebuilt = _keys(app)
        assert [(key.key, key.has_class("-disabled")) for key in rebuilt] == [
            ("d", False),
            ("r", True),
            ("ctrl+p", False),
        ]
        assert all(key not in shown for key in rebuilt)

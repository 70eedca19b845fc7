"""A confirmation dialog, shown before every action that takes a node out of service or away."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Label, Static

__all__ = ["ConfirmModal"]


class ConfirmModal(ModalScreen[bool | None]):
    """Ask before doing something.

    Dismisses with None when the operator cancels, else with the option's state (False without an option).
    Cancel has the focus, so a stray Enter does nothing harmful.

    Args:
        title: the question, `Drain gpu01?`.
        body: what will happen.
        confirm: the confirm button's label, `Drain`.
        option: the label of a checkbox (`Force: skip the drain`), when the action has a variant.
    """

    KEY_MAP_NAME: ClassVar[str] = "confirmation"
    """What the key map calls this screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,n", "cancel", "Cancel"),
        Binding("y", "confirm", "Confirm"),
        Binding("question_mark", "app.help", "Keys", show=False),  # a modal screen hides the app's keys
        Binding("f", "toggle_option", "Toggle the option", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | y | Confirm. |
    | n, escape | Cancel. |
    | f | Tick or clear the option (Force), when the dialog has one. |
    | ? | The key map. |
    """

    def __init__(self, title: str, body: str, *, confirm: str, option: str | None = None) -> None:
        super().__init__()
        self.question = title
        self.body = body
        self.confirm_label = confirm
        self.option = option

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question")
            yield Static(self.body, id="body", markup=False)
            if self.option is not None:
                yield Checkbox(self.option, id="option")
            keys = "y confirms · n or Esc cancels" + (" · f ticks the option" if self.option is not None else "")
            yield Label(keys, id="confirm-keys")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button(self.confirm_label, id="confirm", variant="error", compact=True)

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    def action_confirm(self) -> None:
        """Dismiss with the option's state."""
        option = self.query("#option").first(Checkbox).value if self.option is not None else False
        self.dismiss(option)

    def action_toggle_option(self) -> None:
        """Tick or clear the option's checkbox (no-op without one)."""
        for checkbox in self.query("#option").results(Checkbox):
            checkbox.toggle()

    def action_cancel(self) -> None:
        """Dismiss with None."""
        self.dismiss(None)

    @on(Button.Pressed, "#confirm")
    def _confirmed(self) -> None:
        self.action_confirm()

    @on(Button.Pressed, "#cancel")
    def _cancelled(self) -> None:
        self.action_cancel()

"""The scale dialog of the deployments screen: how many replicas a deployment should keep.

It only asks for a whole number; the deployments screen confirms and sends it (`POST …/scale`), and the daemon
judges the count (its range, the generation). A refusal brings the dialog back with the number typed and the
daemon's reason under it, so nothing typed is lost.
"""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from qiip_tui.widgets import ConsoleInput

__all__ = ["ScaleModal"]


class ScaleModal(ModalScreen[int | None]):
    """Ask for a deployment's replica count.

    Dismisses with the count, or None when the operator cancels. Text that is not a whole number keeps the
    dialog open, the text kept, with the reason under it.

    Args:
        name: the deployment.
        replicas: its replica count now.
        value: the text to start with (what was typed before a refusal); default the count now.
        problem: why the last count was refused, shown under the field.
    """

    KEY_MAP_NAME: ClassVar[str] = "scale"
    """What the key map calls this screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Submit (the deployments screen then asks to confirm). |
    | escape | Cancel. |
    """

    def __init__(self, name: str, replicas: int, *, value: str | None = None, problem: str | None = None) -> None:
        super().__init__()
        self.deployment = name
        self.replicas = replicas
        self.value = str(replicas) if value is None else value
        self.problem = problem

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"Scale {self.deployment}", id="question")
            yield Label(f"It keeps {self.replicas} replica(s) now. How many should it keep?", id="scale-now")
            yield ConsoleInput(self.value, placeholder="replicas, 0 or more", id="replicas", type="text")
            yield Label(self.problem or "", id="scale-problem", markup=False)
            yield Label("Enter submits · Esc cancels", id="confirm-keys")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Scale", id="submit", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one("#scale-problem", Label).display = bool(self.problem)
        self.query_one("#replicas", Input).focus()

    def action_submit(self) -> None:
        """Dismiss with the count, unless the text is not a whole number (then say so, keeping the text)."""
        field = self.query_one("#replicas", Input)
        text = field.value.strip()
        if not text.isdigit():
            problem = self.query_one("#scale-problem", Label)
            said = f"{text!r} is not a whole number" if text else "nothing was typed"
            problem.update(f"replicas: {said}; type the count of replicas, such as 3.")
            problem.display = True
            field.focus()
            return
        self.dismiss(int(text))

    def action_cancel(self) -> None:
        """Dismiss with None."""
        self.dismiss(None)

    @on(Input.Submitted)
    @on(Button.Pressed, "#submit")
    def _submitted(self) -> None:
        self.action_submit()

    @on(Button.Pressed, "#cancel")
    def _cancelled(self) -> None:
        self.action_cancel()

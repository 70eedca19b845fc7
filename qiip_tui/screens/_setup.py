"""The setup form: which host to set up, with which engine, serving which model, sized how (llama.cpp)."""

from __future__ import annotations

from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from qiip_core.nodes import Engine
from qiip_tui._provisioning import ENGINES, setup_sizing
from qiip_tui.widgets import ConsoleInput

__all__ = ["SetupModal", "SetupRequest"]

SetupRequest = tuple[str, Engine, str, dict[str, Any] | None]
"""What the form gives: (hostname, engine, model, the llama.cpp sizing policy or None for
automatic sizing)."""


class SetupModal(ModalScreen[SetupRequest | None]):
    """Ask for a setup's host, engine and model.

        Dismisses with `(hostname, engine, model, sizing)` when the host and model are given and the sizing reads
    (`auto`, empty, or `SLOTSxCONTEXT` for llama.cpp), or None when the operator cancels.

        Args:
            hostname: the host to start with (the one highlighted), if any.
    """

    KEY_MAP_NAME: ClassVar[str] = "setup form"
    """What the key map calls this screen."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("question_mark", "app.help", "Keys", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | tab | The next field. |
    | enter | Set up (in the model field), after a confirmation. |
    | escape | Cancel. |
    """

    def __init__(self, hostname: str = "") -> None:
        super().__init__()
        self.hostname = hostname

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Set up a host", id="question")
            yield ConsoleInput(self.hostname, placeholder="hostname", id="setup-host", compact=True)
            yield Select(list(ENGINES.items()), value=Engine.VLLM, allow_blank=False, id="setup-engine")
            yield ConsoleInput(placeholder="model (Qwen/Qwen3-8B, tiny.gguf)", id="setup-model", compact=True)
            yield ConsoleInput(
                placeholder="sizing: auto, or SLOTSxCONTEXT (2x4096; llama.cpp)", id="setup-sizing", compact=True
            )
            yield Label("", id="setup-problem")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Set up", id="confirm", variant="primary", compact=True)

    def on_mount(self) -> None:
        self.query_one("#setup-model" if self.hostname else "#setup-host", Input).focus()

    def action_submit(self) -> None:
        """Dismiss with the request, or say which field is missing."""
        host = self.query_one("#setup-host", Input).value.strip()
        model = self.query_one("#setup-model", Input).value.strip()
        engine = Engine(str(self.query_one("#setup-engine", Select).value))
        missing = [name for name, value in (("hostname", host), ("model", model)) if not value]
        if missing:
            self.query_one("#setup-problem", Label).update(f"The {' and '.join(missing)} cannot be empty.")
            return
        try:
            sizing = setup_sizing(self.query_one("#setup-sizing", Input).value)
        except ValueError as exc:
            self.query_one("#setup-problem", Label).update(str(exc))
            return
        if sizing is not None and engine is not Engine.LLAMA_CPP:
            self.query_one("#setup-problem", Label).update(
                "A sizing plans llama.cpp; vLLM sizes itself: leave it auto."
            )
            return
        self.dismiss((host, engine, model, sizing))

    def action_cancel(self) -> None:
        """Dismiss with None."""
        self.dismiss(None)

    @on(Input.Submitted)
    @on(Button.Pressed, "#confirm")
    def _submitted(self) -> None:
        self.action_submit()

    @on(Button.Pressed, "#cancel")
    def _cancelled(self) -> None:
        self.action_cancel()

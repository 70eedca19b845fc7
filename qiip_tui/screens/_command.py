"""The `:` command line: one line at the bottom of the screen, as in vim or k9s, that names what to do.

It is a modal screen over the screen it was opened on, so that screen's keys rest while the operator types and
its focus comes back when the line closes. The line is checked before it closes (`qiip_tui._command_line`):
a typo stays on the line with the reason under it, and nothing typed is lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from qiip_tui._command_line import Command, CommandError, complete, parse
from qiip_tui._context import command_context
from qiip_tui.screens._fleet import FleetScreen
from qiip_tui.widgets import ConsoleInput

if TYPE_CHECKING:
    from textual.app import App

    from qiip_tui._fleet import Fleet

__all__ = ["CommandLine", "run_command"]

HINT = "Tab completes · Enter runs · Esc closes"
"""The line under the input while nothing else is to be said."""

_CANDIDATES_SHOWN = 8
"""Completions listed under the line before `…`."""


class CommandLine(ModalScreen[Command | None]):
    """The command line; it closes with the checked `Command`, or None after Esc.

    Args:
        fleet: the fleet whose node ids and models the line completes and checks.
    """

    DEFAULT_CSS = """
    CommandLine {
        background: transparent;
        align: left bottom;
        & #command-line {
            dock: bottom;
            height: auto;
            background: $panel;
        }
        & #command-hint {
            width: 1fr;
            color: $foreground-muted;
            padding: 0 1;
            &.-error {
                color: $error;
            }
        }
        & #command-prompt {
            width: 1;
            margin-left: 1;
            text-style: bold;
        }
        & #command-row {
            height: 1;
        }
        & Input {
            width: 1fr;
        }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("tab", "complete", "Complete"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Run the command (a message under the line when it cannot). |
    | tab | Complete the command, node or model; again to cycle through the choices. |
    | escape | Close the line. |
    """

    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        self.nodes = sorted(fleet.nodes)
        """The node ids the line knows."""
        self.models = sorted({node.model for node in fleet.nodes.values() if node.model})
        """The models the fleet's nodes serve."""
        self._choices: tuple[str, ...] = ()
        self._choice = -1
        self._base = ""
        self._shown = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="command-line"):
            yield Label(HINT, id="command-hint", markup=False)
            with Horizontal(id="command-row"):
                yield Label(":", id="command-prompt")
                yield ConsoleInput(id="command-input", compact=True, select_on_focus=False)

    @property
    def field(self) -> Input:
        """The input."""
        return self.query_one("#command-input", Input)

    def _say(self, text: str, *, error: bool = False) -> None:
        hint = self.query_one("#command-hint", Label)
        hint.update(text)
        hint.set_class(error, "-error")

    def action_close(self) -> None:
        """Close without running anything."""
        self.dismiss(None)

    def action_complete(self) -> None:
        """Complete the word being typed; when several fit, list them, and cycle through them on the next Tab."""
        field = self.field
        if self._choices and field.value == self._shown:
            self._choice = (self._choice + 1) % len(self._choices)
            self._set(self._base + self._choices[self._choice])
            return
        typed = field.value.lstrip()
        completion = complete(typed, nodes=self.nodes, models=self.models)
        self._set(completion.text)
        if len(completion.candidates) > 1:
            # The command word stays; Tab again cycles the word being completed through the candidates.
            self._base = typed.partition(" ")[0] + " " if " " in typed else ""
            self._choices, self._choice = completion.candidates, -1
            shown = " ".join(completion.candidates[:_CANDIDATES_SHOWN])
            more = len(completion.candidates) - _CANDIDATES_SHOWN
            self._say(shown + (f" … and {more} more" if more > 0 else ""))
        elif not completion.candidates:
            self._say(f"Nothing completes {field.value.strip() or 'an empty line'}.", error=True)
        else:
            self._choices = ()
            self._say(HINT)

    def _set(self, text: str) -> None:
        field = self.field
        field.value = text
        field.cursor_position = len(text)
        self._shown = text

    @on(Input.Changed, "#command-input")
    def _changed(self, event: Input.Changed) -> None:
        if event.value != self._shown:
            self._choices = ()
            self._say(HINT)

    @on(Input.Submitted, "#command-input")
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            command = parse(event.value, nodes=self.nodes, models=self.models)
        except CommandError as exc:
            self._say(str(exc), error=True)
            return
        self.dismiss(command)


async def run_command(app: App[Any], command: Command | None) -> None:
    """Do what a checked command says, through the console's own actions (drain and remove still ask first); None
    (the line was closed) does nothing."""
    if command is None:
        return
    console = command_context(app)
    name, argument = command.name, command.argument
    if name in ("drain", "undrain", "remove", "relaunch", "describe"):
        console.node_action(name, argument)
    elif name == "node" and argument is not None:
        console.open_node(argument)
    elif name == "model" and argument is not None:
        await _show_model(app, argument)
    elif name == "fleet":
        console.action_fleet()
    elif name in ("chat", "logs", "models", "deployments"):
        app.switch_mode(name)
    elif name == "help":
        console.action_help()
    elif name == "quit":
        app.exit()


async def _show_model(app: App[Any], model: str) -> None:
    if app.current_mode != "fleet":
        await app.switch_mode("fleet")
    while len(app.screen_stack) > 1:
        await app.pop_screen()
    screen = app.screen
    if isinstance(screen, FleetScreen):
        # The fleet screen's own filter, so the summary says `filter: MODEL` and Esc clears it as usual.
        field = screen.query_one("#filter", Input)
        field.value = model
        field.display = True
        screen.table.focus()

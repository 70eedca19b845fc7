"""The connection screen: shown while the daemon cannot be used, saying which URL, why, and what to check.

The app keeps retrying behind it with a growing delay and leaves it by itself once the daemon answers.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import Footer, Header, Static

from qiip_tui.screens._base import ConsoleScreen

__all__ = ["ConnectionScreen"]


class ConnectionScreen(ConsoleScreen[None]):
    """Why the console cannot use its daemon. Shows `QiipConsole.connection_problem`."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "app.reconnect", "Retry now"),
        Binding("q", "app.quit", "Quit"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | r | Retry now. |
    | q | Quit. |
    """

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="problem"):
            yield Static("", id="problem-title", markup=False)
            yield Static("", id="problem-detail", markup=False)
            yield Static("", id="problem-checks", markup=False)
            yield Static("", id="problem-retry", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.console.connection_signal.subscribe(self, self._changed)
        self._changed(None)

    def _changed(self, _: object) -> None:
        problem = self.console.connection_problem
        if problem is None:
            self.query_one("#problem-title", Static).update(f"Connecting to {self.console.client.url}…")
            return
        self.query_one("#problem-title", Static).update(problem.title)
        detail = Text()
        detail.append("Daemon  ", style="bold")
        detail.append(problem.url)
        detail.append("\nCause   ", style="bold")
        detail.append(problem.cause)
        self.query_one("#problem-detail", Static).update(detail)
        checks = Text("Check:", style="bold")
        for check in problem.checks:
            checks.append(f"\n • {check}")
        self.query_one("#problem-checks", Static).update(checks)
        attempt, delay = self.console.connection_attempt
        self.query_one("#problem-retry", Static).update(
            f"Attempt {attempt} failed; the next one is in {delay:g} s. The console reconnects by itself "
            "(r retries now)."
        )

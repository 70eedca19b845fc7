"""The connection screen: shown while the daemon cannot be used, saying which URL, why, and what to check.

The app keeps retrying behind it with a growing delay and leaves it by itself once the daemon answers. When the
daemon refuses the credentials the app stops (the same ones would be refused again, and each refusal counts
against the daemon's throttle), and this screen asks for the admin user and password.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Header, Input, Label, Static

from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import ConsoleInput, KeyFooter

__all__ = ["ConnectionScreen"]


class ConnectionScreen(ConsoleScreen[None]):
    """Why the console cannot use its daemon. Shows `ConnectionWatch.problem`."""

    AUTO_FOCUS = ""
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "app.reconnect", "Retry now"),
        Binding("q", "app.quit", "Quit"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | r | Retry now. |
    | q | Quit. |
    | enter | In the password field: connect with the user and password typed. |
    """

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="problem"):
            yield Static("", id="problem-title", markup=False)
            yield Static("", id="problem-detail", markup=False)
            yield Static("", id="problem-retry", markup=False)
            # Above the checks, so the fields are on screen at 80×24.
            with Vertical(id="login"):
                with Horizontal(classes="login-row"):
                    yield Label("User     ", classes="login-label")
                    yield ConsoleInput(id="login-username", compact=True)
                with Horizontal(classes="login-row"):
                    yield Label("Password ", classes="login-label")
                    yield ConsoleInput(id="login-password", password=True, compact=True)
            yield Static("", id="problem-checks", markup=False)
        yield KeyFooter()

    def on_mount(self) -> None:
        self.console.connection.signal.subscribe(self, self._changed)
        self._changed(None)

    def _changed(self, _: object) -> None:
        problem = self.console.connection.problem
        login = self.query_one("#login")
        if problem is None:
            self._hide_login()
            self.query_one("#problem-title", Static).update(f"Connecting to {self.console.client.url}…")
            self.query_one("#problem-retry", Static).update("")
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
        attempt, delay = self.console.connection.attempt
        retry = self.query_one("#problem-retry", Static)
        if delay is None:
            retry.update(
                "The console does not try these credentials again. Type the admin user and password, then Enter."
            )
            if not login.display:
                login.display = True
                self.query_one("#login-username", Input).value = self.console.connection.config.username or "admin"
                password = self.query_one("#login-password", Input)
                password.value = ""
                password.focus()
            return
        self._hide_login()
        retry.update(
            f"Attempt {attempt} failed; the next one is in {delay:g} s. The console reconnects by itself "
            "(r retries now)."
        )

    def _hide_login(self) -> None:
        login = self.query_one("#login")
        if login.display:
            login.display = False
            self.set_focus(None)

    @on(Input.Submitted, "#login-username")
    def _username_given(self) -> None:
        self.query_one("#login-password", Input).focus()

    @on(Input.Submitted, "#login-password")
    def _login(self) -> None:
        username = self.query_one("#login-username", Input).value.strip()
        password = self.query_one("#login-password", Input).value
        if not username or not password:
            self.notify("Type both the admin user and the password.", severity="warning")
            return
        if not self.console.connection.retry_with(username, password):
            self.notify("This console's client cannot change its credentials; restart it with others.")

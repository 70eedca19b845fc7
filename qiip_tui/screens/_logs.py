"""The provisioning logs screen. The daemon does not provision nodes yet, so it says so; its log view follows
a daemon's provisioning log as soon as the client offers one (`ProvisioningLogSource`)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Footer, Header, Static

from qiip_tui._types import ProvisioningLogSource
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import LogView

__all__ = ["NOT_AVAILABLE", "LogsScreen"]

NOT_AVAILABLE = (
    "Provisioning logs are not available on this daemon: it does not provision nodes over SSH yet. "
    "This screen follows them once it does."
)
"""What the screen says when the daemon has no provisioning log."""


class LogsScreen(ConsoleScreen[None]):
    """Provisioning output, as it happens."""

    AUTO_FOCUS = "#log-lines"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("q", "app.fleet", "Back")]
    """
    | Key | Action |
    | :- | :- |
    | space | Pause or resume following. |
    | / | Search. |
    | q | Back to the fleet. |
    """

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="logs-banner", markup=False)
        yield LogView(id="log-view")
        yield Footer()

    def on_mount(self) -> None:
        banner = self.query_one("#logs-banner", Static)
        client = self.console.client
        if isinstance(client, ProvisioningLogSource):
            banner.display = False
            self.query_one("#log-view", LogView).follow_source(client.provisioning_logs())
        else:
            banner.update(NOT_AVAILABLE)

    def on_log_view_source_ended(self, message: LogView.SourceEnded) -> None:
        if message.error:
            self.notify(message.error, title="Provisioning log", severity="error")

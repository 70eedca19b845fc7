"""The console application. For now a placeholder screen; the fleet, node, log, sizing and chat screens
build on it."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import Footer, Header, Static

__all__ = ["QiipConsole"]


class QiipConsole(App[None]):
    """The operator console.

    Args:
        url: the daemon's base URL.
    """

    TITLE = "QIIP"
    BINDINGS = [("q", "quit", "Quit")]

    def __init__(self, url: str = "http://127.0.0.1:8080") -> None:
        super().__init__()
        self.url = url

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(f"QIIP console — daemon at {self.url}\n\nThe fleet screens are not built yet.", id="placeholder")
        yield Footer()

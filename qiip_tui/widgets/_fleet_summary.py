"""The line above the fleet table: nodes by status, the request rate, the daemon and the filter."""

from __future__ import annotations

from rich.text import Text
from textual.theme import Theme
from textual.widgets import Static

from qiip_tui._fleet import Fleet
from qiip_tui._render import DASH, Palette

__all__ = ["FleetSummary"]


class FleetSummary(Static):
    """One line: `12 nodes · 3.4 req/s │ 9 healthy 1 draining 2 unhealthy │ filter: gpu`.

    The owner calls `show()` when the fleet, the connection or the filter changes.
    """

    DEFAULT_CSS = """
    FleetSummary {
        height: 1;
        width: 1fr;
        padding: 0 1;
        background: $panel;
        color: $foreground;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self._palette = Palette()
        self._last: tuple[Fleet, str, str] | None = None
        self._shown = Text()

    def on_mount(self) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)

    def _theme_changed(self, theme: Theme) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        if self._last is not None:
            self.show(*self._last)

    def show(self, fleet: Fleet, connection: str, filter_text: str) -> None:
        """Render the summary.

        Args:
            fleet: the fleet.
            connection: the connection's state, shown when not connected (`connecting to …`).
            filter_text: the table's filter, shown when set.
        """
        self._last = (fleet, connection, filter_text)
        text = Text()
        if connection:
            text.append(connection)
        else:
            rate = fleet.requests_per_s
            text.append(f"{len(fleet.nodes)} node{'s' if len(fleet.nodes) != 1 else ''}", style="bold")
            text.append(f" · {rate:.1f} req/s │" if rate is not None else f" · {DASH} req/s │")
            for status, count in fleet.status_counts():
                text.append(" ")
                text.append(f"{count} {status}", style=self._palette.status(status))
        if filter_text:
            text.append(" │ ")
            text.append(f"filter: {filter_text}", style="italic")
        if text != self._shown:
            self._shown = text
            # One line of fixed size: no layout pass, which would repaint the whole screen.
            self.update(text, layout=False)

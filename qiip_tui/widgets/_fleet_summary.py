"""The lines above the fleet table: the fleet and the connection, each model's health, and QUADS' lent hosts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rich.text import Text
from textual.theme import Theme
from textual.widgets import Static

from qiip_tui._fleet import Fleet
from qiip_tui._quads import quads_summary
from qiip_tui._render import DASH, Palette, age_text

__all__ = ["FleetSummary", "SummaryView"]


@dataclass(frozen=True)
class SummaryView:
    """What the summary shows besides the fleet."""

    connected: bool
    """Whether the daemon answered the last attempt."""
    connection: str = ""
    """The connection's state in a few words, shown when not connected and nothing was received yet."""
    updated_at: datetime | None = None
    """When the console last heard from the daemon (UTC)."""
    now: datetime | None = None
    """The time the summary is drawn at, for the age of `updated_at`."""
    shown: int = 0
    """Rows the table shows."""
    filter_text: str = ""
    """The table's filter."""
    problems_only: bool = False
    """Whether the table shows only the nodes that need attention."""
    marked: int = 0
    """Nodes marked in the table (Space) for an action on all of them."""


class FleetSummary(Static):
    """Two lines, and a third when the daemon reads QUADS:

    ```
    ● live 12:03:04 │ 12 nodes · 3.4 req/s │ 3/12 shown · filter: gpu │ 9 healthy 1 draining 2 unhealthy
    m2 0/1 healthy · 15% errors │ qwen3-8b 9/10 healthy · 0.2% errors │ …
    QUADS: next return gpu03 in 2h 14m · 2 hosts not provisioned: gpu07 8× H100, gpu08 4× A100
    ```

    A model with no healthy node is in the error colour, and models are listed worst first; the QUADS line is
    `qiip_tui._quads.quads_summary`. The owner calls `show()` when the fleet, the connection or the filter changes,
    and on each metrics poll (the countdown moves on).
    """

    DEFAULT_CSS = """
    FleetSummary {
        height: 2;
        width: 1fr;
        padding: 0 1;
        background: $panel;
        color: $foreground;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self._palette = Palette()
        self._last: tuple[Fleet, SummaryView] | None = None
        self._shown = Text()

    def on_mount(self) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)

    def _theme_changed(self, theme: Theme) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        if self._last is not None:
            self._shown = Text()
            self.show(*self._last)

    def show(self, fleet: Fleet, view: SummaryView) -> None:
        """Render the summary of `fleet` and the table's state `view`."""
        self._last = (fleet, view)
        palette = self._palette
        text = Text(no_wrap=True, overflow="ellipsis")
        if view.connected:
            text.append("● live", style=palette.status("healthy"))
            if view.updated_at is not None:
                text.append(f" {view.updated_at:%H:%M:%S}")
        else:
            text.append("○ not connected", style=palette.status("unhealthy"))
            if view.updated_at is not None and view.now is not None:
                text.append(f" · data from {view.updated_at:%H:%M:%S} ({age_text(view.updated_at, view.now)})")
            elif view.updated_at is None:
                text.append(f" · {view.connection}" if view.connection else "")
        text.append(" │ ")
        rate = fleet.requests_per_s
        count = len(fleet.nodes)
        text.append(f"{count} node{'s' if count != 1 else ''}", style="bold")
        text.append(f" · {rate:.1f} req/s │" if rate is not None else f" · {DASH} req/s │")
        if view.filter_text or view.problems_only:
            # Before the status counts: on a narrow terminal the end of the line is cut.
            text.append(f" {view.shown}/{count} shown", style="bold")
            if view.problems_only:
                text.append(" · problems only", style="italic")
            if view.filter_text:
                text.append(f" · filter: {view.filter_text}", style="italic")
            text.append(" │")
        if view.marked:
            text.append(f" {view.marked} marked", style="bold reverse")
            text.append(" │")
        for status, number in fleet.status_counts():
            text.append(" ")
            text.append(f"{number} {status}", style=palette.status(status))
        text.append("\n")
        text.append_text(self._models(fleet))
        quads = quads_summary(fleet.lent, fleet.nodes.values(), view.now, palette) if view.now is not None else None
        if quads is not None:
            text.append("\n")
            text.append_text(quads)
        if not view.connected:
            text.stylize("dim", 0, len(text))
        if text != self._shown or text.spans != self._shown.spans:
            self._shown = text
            height = 3 if quads is not None else 2
            if self.styles.height is None or self.styles.height.value != height:
                self.styles.height = height  # the QUADS line came or went: a layout pass, once
            # Lines of fixed size: no layout pass, which would repaint the whole screen.
            self.update(text, layout=False)

    def _models(self, fleet: Fleet) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        for index, model in enumerate(fleet.model_summaries()):
            if index:
                text.append(" │ ")
            style = self._palette.status("unhealthy") if model.healthy == 0 else None
            text.append(model.model, style=style or "bold")
            text.append(f" {model.healthy}/{model.nodes} healthy", style=style or "")
            if model.error_ratio:
                percent = model.error_ratio * 100
                text.append(
                    f" · {percent:.1f}% errors" if percent < 10 else f" · {percent:.0f}% errors",
                    style=self._palette.status("unhealthy"),
                )
        if not text:
            text.append("no models served", style="dim")
        return text

"""A bounded log: coloured by level (and each step's label by whether the step failed), following the end
unless paused, searchable, fed by an async iterator.

Only the last `max_lines` records are kept, so a chatty source cannot grow the console without bound. A search
shows the matching records only, with the matches highlighted; clearing it shows everything again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.theme import Theme
from textual.widgets import Input, Label, RichLog

from qiip_core import QiipError
from qiip_tui._key_router import focus_now
from qiip_tui._render import Palette
from qiip_tui._types import LogRecord
from qiip_tui.widgets._console_input import ConsoleInput

__all__ = ["LogView"]

_LEVELS = ("debug", "info", "warning", "error")


class LogView(Vertical):
    """A log of `LogRecord`s.

    Args:
        max_lines: records kept; older ones are dropped.
    """

    DEFAULT_CSS = """
    LogView {
        height: 1fr;
        & RichLog { height: 1fr; background: $surface; }
        & #log-search { display: none; }
        & #log-search.-shown { display: block; }
        & #log-status { height: 1; color: $foreground-muted; padding: 0 1; }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_follow", "Pause/follow"),
        Binding("slash", "search", "Search"),
        Binding("escape", "clear_search", "Clear search", show=False),
    ]
    """
    | Key | Action |
    | :- | :- |
    | space | Pause or resume following the end. |
    | / | Search. |
    | escape | Clear the search. |
    """

    following: reactive[bool] = reactive(True)
    """Whether new records scroll the log to its end."""

    class Received(Message):
        """Records arrived from the source.

        Posted by `LogView.follow_source` (to itself). Handled by `LogView.on_log_view_received`.
        """

        def __init__(self, record: LogRecord) -> None:
            super().__init__()
            self.record = record
            """The record."""

    class SourceEnded(Message):
        """The source ended, or failed.

        Posted by `LogView.follow_source`. Handled by `on_log_view_source_ended` (bubbles to the screen).
        """

        def __init__(self, error: str | None, view: LogView | None = None) -> None:
            super().__init__()
            self.error = error
            """Why it failed; None when it ended cleanly."""
            self.view = view
            """The log view whose source ended."""

        @property
        def control(self) -> LogView | None:
            """The log view whose source ended (for `@on(LogView.SourceEnded, "#id")`)."""
            return self.view

    class Searched(Message):
        """The operator changed the search.

        Posted by `LogView` as the search is typed or cleared. Handled by `on_log_view_searched` (bubbles to the
        screen, which remembers it).
        """

        def __init__(self, view: LogView, text: str) -> None:
            super().__init__()
            self.view = view
            """The log view searched."""
            self.text = text
            """The search; empty when cleared."""

        @property
        def control(self) -> LogView:
            """The log view searched (for `@on(LogView.Searched, "#id")`)."""
            return self.view

    def __init__(self, *, max_lines: int = 5000, id: str | None = None) -> None:
        super().__init__(id=id)
        self.max_lines = max_lines
        self.records: deque[LogRecord] = deque(maxlen=max_lines)
        """The records kept, oldest first."""
        self.search_text = ""
        """The search; empty shows every record."""
        self._palette = Palette()
        # Steps (record sources) that logged an error: their label is in the error colour.
        self._failed_sources: set[str] = set()

    def compose(self) -> ComposeResult:
        yield ConsoleInput(placeholder="search", id="log-search", compact=True)
        yield RichLog(max_lines=self.max_lines, wrap=False, markup=False, highlight=False, id="log-lines")
        yield Label("", id="log-status")

    def on_mount(self) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)
        self._show_status()

    def _theme_changed(self, theme: Theme) -> None:
        self._palette = Palette.from_variables(self.app.theme_variables)
        self._redraw()

    # -- records -----------------------------------------------------------------------------------------

    @work(exclusive=True, group="log-source", exit_on_error=False)
    async def follow_source(self, source: AsyncIterator[LogRecord]) -> None:
        """Read `source` to its end, showing each record."""
        try:
            async for record in source:
                self.post_message(self.Received(record))
        except QiipError as exc:
            self.post_message(self.SourceEnded(exc.message, self))
            return
        self.post_message(self.SourceEnded(None, self))

    def on_log_view_received(self, message: LogView.Received) -> None:
        message.stop()
        self.write(message.record)

    def write(self, record: LogRecord) -> None:
        """Add a record (dropping the oldest beyond `max_lines`)."""
        self.records.append(record)
        if self._matches(record):
            self.query_one(RichLog).write(self._render_record(record), scroll_end=self.following)
        self._show_status()

    def clear(self) -> None:
        """Forget every record (before following another source)."""
        self.records.clear()
        self._failed_sources.clear()
        self.query_one(RichLog).clear()
        self._show_status()

    def _matches(self, record: LogRecord) -> bool:
        wanted = self.search_text.casefold()
        return (
            not wanted
            or wanted in record.message.casefold()
            or wanted in record.source.casefold()
            or wanted in (record.tag or "").casefold()
        )

    def _render_record(self, record: LogRecord) -> Text:
        level = record.level if record.level in _LEVELS else "info"
        text = Text()
        if record.at is not None:
            text.append(record.at.strftime("%H:%M:%S "), style=self._palette.style("log-debug"))
        if record.tag is None:
            text.append(f"{level.upper():<7} ", style=self._palette.style(f"log-{level}"))
        elif record.tag:
            text.append(f"{record.tag:<14} ", style=self._palette.style(record.tag_style or f"log-{level}"))
        if record.source:
            # Each step in the colour of how it is going: an error marks its step failed from then on.
            if level == "error":
                self._failed_sources.add(record.source)
            failed = record.source in self._failed_sources
            text.append(
                f"{record.source}: ", style=self._palette.style("log-error") + Style(bold=True) if failed else "bold"
            )
        text.append(record.message, style=self._palette.style(f"log-{level}") if level == "error" else "")
        if self.search_text:
            text.highlight_words([self.search_text], style="reverse", case_sensitive=False)
        return text

    def _redraw(self) -> None:
        log = self.query_one(RichLog)
        log.clear()
        for record in self.records:
            if self._matches(record):
                log.write(self._render_record(record), scroll_end=False)
        if self.following:
            log.scroll_end(animate=False)
        self._show_status()

    def _show_status(self) -> None:
        parts = ["following" if self.following else "paused (space to follow)", f"{len(self.records):,} lines"]
        if self.search_text:
            found = sum(1 for record in self.records if self._matches(record))
            parts.append(f"search {self.search_text!r}: {found:,} matching")
        self.query_one("#log-status", Label).update(" · ".join(parts))

    # -- keys --------------------------------------------------------------------------------------------

    def watch_following(self, following: bool) -> None:
        if not self.is_mounted:
            return
        log = self.query_one(RichLog)
        log.auto_scroll = following
        if following:
            log.scroll_end(animate=False)
        self._show_status()

    def action_toggle_follow(self) -> None:
        """Pause or resume following the end."""
        self.following = not self.following

    def action_search(self) -> None:
        """Show the search field."""
        field = self.query_one("#log-search", Input)
        field.add_class("-shown")
        focus_now(field)

    def action_clear_search(self) -> None:
        """Clear the search and show every record."""
        field = self.query_one("#log-search", Input)
        field.value = ""
        field.remove_class("-shown")
        focus_now(self.query_one(RichLog))

    def set_search(self, text: str) -> None:
        """Search for `text` (shown in the search field), as if typed; empty clears the search."""
        field = self.query_one("#log-search", Input)
        field.set_class(bool(text), "-shown")
        field.value = text

    @on(Input.Changed, "#log-search")
    def _search_changed(self, event: Input.Changed) -> None:
        event.stop()
        text = event.value.strip()
        if text != self.search_text:
            self.search_text = text
            self._redraw()
            self.post_message(self.Searched(self, text))

    @on(Input.Submitted, "#log-search")
    def _search_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        focus_now(self.query_one(RichLog))

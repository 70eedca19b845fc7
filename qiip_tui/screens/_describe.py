"""The describe view (`d`, as in k9s): everything about one node as text: its state, all the errors the daemon
keeps for it with their times and counts, the fleet journal's events about it, and its whole record.

The text follows the node live (the console's fleet) and reads the journal once when it opens. `y` copies it to the
clipboard of the operator's terminal (OSC 52, which works over SSH where the terminal allows it), for an issue or
a chat.
"""

from __future__ import annotations

from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Header, Label, Static

from qiip_core.client import ClientError
from qiip_tui._describe import describe_node
from qiip_tui._fleet import FleetDelta
from qiip_tui._journal import journal_record
from qiip_tui._types import JournalSource, LogRecord
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import KeyFooter

__all__ = ["DescribeScreen"]


class DescribeScreen(ConsoleScreen[None]):
    """One node, described in full.

    Args:
        node_id: the node.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "copy", "Copy"),
        Binding("escape,q", "back", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | y | Copy the description to the terminal's clipboard (OSC 52). |
    | ↑ ↓ PgUp PgDn | Scroll. |
    | escape, q | Back. |
    """

    class EventsRead(Message):
        """The journal's events about the node were read (or could not be).

        Posted by `DescribeScreen._read_events`. Handled by `DescribeScreen.on_describe_screen_events_read`.
        """

        def __init__(self, events: list[LogRecord] | None, error: str | None = None) -> None:
            super().__init__()
            self.events = events
            """The node's journal rows, oldest first; None when the daemon keeps no journal."""
            self.error = error
            """Why the journal could not be read."""

    def __init__(self, node_id: str) -> None:
        super().__init__()
        self.node_id = node_id
        self.text = ""
        """The description shown (what `y` copies)."""
        self._events: list[LogRecord] | None = []
        self._events_note = "reading the journal…"

    def compose(self) -> ComposeResult:
        yield Header()
        yield Label(f"Describe {self.node_id}", id="describe-title")
        with VerticalScroll(id="describe-body"):
            yield Static("", id="describe-text", markup=False)
        yield KeyFooter()

    def on_mount(self) -> None:
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self._show()
        self.query_one("#describe-body").focus()
        self._read_events()

    @work(exclusive=True, group="describe-events", exit_on_error=False)
    async def _read_events(self) -> None:
        client = self.console.client
        if not isinstance(client, JournalSource):
            self.post_message(self.EventsRead(None))
            return
        try:
            events = [journal_record(e) async for e in client.journal(follow=False) if e.get("node") == self.node_id]
        except ClientError as exc:
            self.post_message(self.EventsRead([], exc.message))
            return
        self.post_message(self.EventsRead(events))

    def on_describe_screen_events_read(self, message: EventsRead) -> None:
        self._events = message.events
        self._events_note = f"the journal could not be read: {message.error}" if message.error else ""
        self._show()

    def _fleet_changed(self, delta: FleetDelta) -> None:
        if self.node_id in delta.changed or self.node_id in delta.removed or not delta:
            self._show()

    def _show(self) -> None:
        node = self.console.fleet.nodes.get(self.node_id)
        if node is None:
            self.text = f"{self.node_id} has left the fleet."
        else:
            self.text = describe_node(node, now=self.console.wall_clock(), events=self._events)
            if self._events_note:
                self.text += f"\n\n({self._events_note})"
        self.query_one("#describe-text", Static).update(self.text)

    def action_copy(self) -> None:
        """Copy the description to the terminal's clipboard (OSC 52)."""
        self.app.copy_to_clipboard(self.text)
        lines = self.text.count("\n") + 1
        self.notify(
            f"{lines} lines about {self.node_id} sent to the clipboard (OSC 52; a terminal that does not allow it "
            "keeps its clipboard).",
            title="Copied",
        )

    def action_back(self) -> None:
        """Back to where the view was opened."""
        self.dismiss()

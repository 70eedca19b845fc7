"""The fleet screen, the console's home: every node in a sortable, filterable table that follows the daemon."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Header, Input, Static

from qiip_tui._fleet import FleetDelta
from qiip_tui._fleet_cells import COLUMN_KEYS
from qiip_tui._key_router import focus_now
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import ConsoleInput, FleetSummary, FleetTable, KeyFooter, SummaryView

__all__ = ["FleetScreen"]

VIEW = "fleet"
"""The name the screen's sort and filter are remembered under."""


class FleetScreen(ConsoleScreen[None]):
    """Nodes, their state and load; Enter opens one. The app keeps the fleet current and publishes its changes
    on `ConsoleContext.fleet_signal`, which this screen hands to its table. The sort, the filter and problems-only
    are remembered between runs (`Preferences`, view `fleet`)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("e", "problems", "Problems"),
        Binding("d", "node('describe')", "Describe"),
        Binding("D", "node('drain')", "Drain"),
        Binding("u", "node('undrain')", "Undrain"),
        Binding("x", "node('remove')", "Remove"),
        Binding("r", "node('relaunch')", "Relaunch"),
        Binding("p", "node('power')", "Power", show=False),
        Binding("q", "app.quit", "Quit"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Open the highlighted node. |
    | / | Filter by id, model, status or engine. |
    | escape | Clear the filter; without one, unmark the marked nodes. |
    | space | Mark the highlighted node (D u x then act on every marked node, after one confirmation). |
    | e | Show only the nodes that need attention, or every node again. |
    | s / S | Sort by the next column / reverse the sort (the default: status, problems first). |
    | ← → | Scroll the columns sideways, one at a time (the node column stays). |
    | d | Describe the highlighted node: its state, errors, events and record, as text (`y` copies it). |
    | D u x r p | Drain, undrain, remove, relaunch, power the highlighted node. |
    | q | Quit. |
    """

    def compose(self) -> ComposeResult:
        yield Header()
        yield FleetSummary(id="summary")
        yield FleetTable(self.console.fleet, now=self.console.wall_clock, id="fleet")
        yield Static("", id="fleet-empty", markup=False)
        yield ConsoleInput(placeholder="filter: id, model, status or engine", id="filter", compact=True)
        yield KeyFooter()

    def on_mount(self) -> None:
        field = self.query_one("#filter", Input)
        field.display = False
        self.query_one("#fleet-empty", Static).display = False
        self._restore(field)
        self.table.set_stale(not self.console.connection.connected)
        self.console.fleet_signal.subscribe(self, self._fleet_changed)
        self.console.connection.signal.subscribe(self, self._connection_changed)
        self._show_summary()

    def _restore(self, field: Input) -> None:
        """Sort and filter as the operator left them."""
        view, table = self.console.preferences.view(VIEW), self.table
        if view.sort in COLUMN_KEYS:
            table.sort_by(view.sort, reverse=view.reverse)
        table.set_problems_only(view.problems_only)
        if view.filter:
            field.value = view.filter
            field.display = True

    @property
    def table(self) -> FleetTable:
        """The fleet table."""
        return self.query_one("#fleet", FleetTable)

    def _fleet_changed(self, delta: FleetDelta) -> None:
        table = self.table
        table.sync(delta)
        if not delta:
            # A metrics poll: the errors' ages moved on.
            table.refresh_ages()
        self._show_summary()

    def _connection_changed(self, _: object) -> None:
        self.table.set_stale(not self.console.connection.connected)
        self._show_summary()

    def _show_summary(self) -> None:
        console, table = self.console, self.table
        view = SummaryView(
            connected=console.connection.connected,
            connection=console.connection.text,
            updated_at=console.last_update,
            now=console.wall_clock(),
            shown=table.shown_count,
            filter_text=table.filter_text,
            problems_only=table.problems_only,
            marked=len(table.marked),
        )
        self.query_one("#summary", FleetSummary).show(console.fleet, view)
        empty = self.query_one("#fleet-empty", Static)
        nodes = len(console.fleet.nodes)
        if table.shown_count or not nodes:
            empty.display = False
            return
        what = []
        if table.problems_only:
            what.append("needs attention")
        if table.filter_text:
            what.append(f"matches {table.filter_text!r}")
        hints = (["Esc clears the filter"] if table.filter_text else []) + (
            ["e shows every node"] if table.problems_only else []
        )
        empty.update(
            f"No node {' and '.join(what)} ({nodes} node{'s' if nodes != 1 else ''} in the fleet): {' · '.join(hints)}."
        )
        empty.display = True

    def action_problems(self) -> None:
        """Show only the nodes that need attention (not healthy, breaker not closed, failing), or all again."""
        self.table.set_problems_only(not self.table.problems_only)
        self.console.preferences.remember_view(VIEW, problems_only=self.table.problems_only)
        self._show_summary()

    # -- filter ------------------------------------------------------------------------------------------

    def action_filter(self) -> None:
        """Show the filter and focus it."""
        field = self.query_one("#filter", Input)
        field.display = True
        focus_now(field)

    def action_clear_filter(self) -> None:
        """Clear and hide the filter."""
        field = self.query_one("#filter", Input)
        if not field.display and not field.value:
            self.table.clear_marks()
            return
        field.value = ""
        field.display = False
        self.table.set_filter("")
        focus_now(self.table)
        self._show_summary()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.table.set_filter(event.value.strip())
        self.console.preferences.remember_view(VIEW, filter=event.value.strip())
        self._show_summary()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        field = self.query_one("#filter", Input)
        field.display = bool(event.value.strip())
        focus_now(self.table)

    # -- nodes -------------------------------------------------------------------------------------------

    @on(FleetTable.NodeChosen)
    def _open(self, event: FleetTable.NodeChosen) -> None:
        self.console.open_node(event.node_id)

    def action_node(self, action: str) -> None:
        """Run a node action (`describe`, `drain`, `undrain`, `remove`, `relaunch`, `power`) on the highlighted
        node; drain, undrain and remove act on every marked node instead when some are marked (one confirmation
        lists them)."""
        table = self.table
        if action in ("drain", "undrain", "remove") and table.marked:
            self.console.nodes_action(action, sorted(table.marked), then=table.clear_marks)
        else:
            self.console.node_action(action, table.highlighted_node)

    def on_fleet_table_changed(self) -> None:
        table = self.table
        self.console.preferences.remember_view(VIEW, sort=table.sort_column, reverse=table.sort_reverse)
        self._show_summary()

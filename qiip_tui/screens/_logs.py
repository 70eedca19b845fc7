"""The logs screen: the fleet's timeline, the engine log of a node, and the provisioning tasks with their logs.

Three panes (keys 1, 2, 3):

- **Timeline**: the daemon's journal (`journal`), its kept history first (events from before the console
  connected), then each new event as it happens: time (UTC), node, event, what changed and why.
- **Engine log**: the nodes of the fleet; Enter follows the highlighted node's engine log (`engine_log`), the
  llama-server output of a node the daemon launched itself. `l` on a node's screen opens this pane on that node.
- **Provisioning**: the task table polls `provisioning_tasks()` while the screen is shown; Enter on a host follows
  its log (`host_log`). The host actions (set up, cancel, tear down, power) are the app's (`HostActions`).

Every log searches with `/` and pauses with space (`LogView`). A daemon without the journal or provisioning gets a
banner in that pane, and the rest works.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.timer import Timer
from textual.widgets import DataTable, Header, Static, TabbedContent, TabPane

from qiip_core.client import ClientError
from qiip_tui._journal import engine_records, journal_records
from qiip_tui._key_router import focus_now
from qiip_tui._provisioning import TASK_COLUMNS, log_records, task_cells
from qiip_tui._render import Palette, status_text
from qiip_tui._types import JournalSource, ProvisioningSource
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import ConsoleTable, KeyFooter, LogView

__all__ = ["NOT_AVAILABLE", "NO_JOURNAL", "LogsScreen"]

NOT_AVAILABLE = "This daemon does not provision hosts (/admin/provisioning); upgrade it to set hosts up from here."
"""What the provisioning pane says when the client cannot ask for provisioning tasks."""

NO_JOURNAL = (
    "This daemon keeps no journal or engine logs (/admin/journal, /admin/nodes/{id}/log); upgrade it to see the "
    "fleet's timeline here."
)
"""What the timeline and engine-log panes say when the client cannot ask for them."""

_STATE_STYLES = {"running": "provisioning", "succeeded": "healthy", "failed": "failed", "cancelled": "unknown"}
_PANES = ("timeline", "engine", "provisioning")
_NODE_COLUMNS = ("Node", "Status", "Engine", "Source")
_PANE_LOGS = {"timeline": "#timeline-view", "engine": "#engine-log", "provisioning": "#log-view"}


class LogsScreen(ConsoleScreen[None]):
    """The fleet's timeline, a node's engine log, and provisioning tasks with the log of one host."""

    AUTO_FOCUS = "#timeline RichLog"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "pane('timeline')", "Timeline"),
        Binding("2", "pane('engine')", "Engine log"),
        Binding("3", "pane('provisioning')", "Provisioning"),
        Binding("slash", "search", "Search the log"),
        Binding("space", "toggle_follow", "Pause/follow"),
        Binding("s", "host('setup')", "Set up", show=False),
        Binding("x", "host('cancel')", "Cancel", show=False),
        Binding("t", "host('teardown')", "Tear down", show=False),
        Binding("o", "host('power_on')", "Power on", show=False),
        Binding("O", "host('power_off')", "Power off", show=False),
        Binding("r", "host('power_restart')", "Restart", show=False),
        Binding("q", "app.fleet", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | 1, 2, 3 | Show the timeline, the engine log, or the provisioning pane. |
    | enter | Follow the highlighted node's engine log, or host's provisioning log. |
    | s | Provisioning pane: set up a host (a form, then a confirmation). |
    | x | Provisioning pane: cancel the highlighted host's running setup or teardown (asks first). |
    | t | Provisioning pane: tear the highlighted host's node down (asks first). |
    | o, O, r | Provisioning pane: power the highlighted host on, off, or restart it (asks first). |
    | space | Pause or resume following the log of the pane shown. |
    | / | Search the log of the pane shown (from its table too). |
    | q | Back to the fleet. |

    Keys act on the pane shown only: the host keys do nothing on the timeline or engine-log pane.
    """

    class Loaded(Message):
        """The daemon answered with its task records (or could not).

        Posted by `LogsScreen._load`. Handled by `LogsScreen.on_logs_screen_loaded`.
        """

        def __init__(self, tasks: list[dict[str, Any]], error: str | None) -> None:
            super().__init__()
            self.tasks = tasks
            """Every host's last task."""
            self.error = error
            """Why the daemon could not be asked."""

    def __init__(self) -> None:
        super().__init__()
        self.host: str | None = None
        """The host whose provisioning log is shown."""
        self.engine_node: str | None = None
        """The node whose engine log is shown."""
        self._timer: Timer | None = None
        self._timeline_ended = False

    def compose(self) -> ComposeResult:
        yield Header()
        initial = "engine" if self.console.engine_log_node is not None else "timeline"
        with TabbedContent(id="logs-panes", initial=initial):
            with TabPane("Timeline", id="timeline"):
                yield Static("Reading the fleet's journal…", id="timeline-banner", markup=False)
                yield LogView(id="timeline-view")
            with TabPane("Engine log", id="engine"):
                yield Static(NO_JOURNAL, id="engine-banner", markup=False)
                nodes: ConsoleTable[str | Text] = ConsoleTable(
                    id="engine-nodes", cursor_type="row", zebra_stripes=True, enter="Follow its engine log"
                )
                yield nodes
                yield Static("Pick a node and press Enter to follow its engine log.", id="engine-title", markup=False)
                yield LogView(id="engine-log")
            with TabPane("Provisioning", id="provisioning"):
                yield Static("Reading the provisioning tasks…", id="logs-banner", markup=False)
                table: ConsoleTable[str | Text] = ConsoleTable(
                    id="tasks", cursor_type="row", zebra_stripes=True, enter="Follow its log"
                )
                yield table
                yield Static("Pick a host and press Enter to follow its log.", id="log-title", markup=False)
                yield LogView(id="log-view")
        yield KeyFooter()

    def on_mount(self) -> None:
        for pane, selector in _PANE_LOGS.items():
            search = self.console.preferences.view(f"logs.{pane}").filter
            if search:
                self.query_one(selector, LogView).set_search(search)
        self.query_one("#tasks", DataTable).add_columns(*TASK_COLUMNS)
        self.query_one("#engine-nodes", DataTable).add_columns(*_NODE_COLUMNS)
        journal = isinstance(self.console.client, JournalSource)
        self.query_one("#engine-banner", Static).display = not journal
        if journal:
            self._follow_timeline()
        else:
            self.query_one("#timeline-banner", Static).update(NO_JOURNAL)
        self._show_nodes()
        self._open_requested_node()
        if not isinstance(self.console.client, ProvisioningSource):
            self.query_one("#logs-banner", Static).update(NOT_AVAILABLE)
            self._timer = self.set_interval(self.console.node_poll_s, self._show_nodes)
            return
        self._load()
        self._timer = self.set_interval(self.console.node_poll_s, self._poll)

    def _poll(self) -> None:
        self._load()
        self._show_nodes()

    def on_screen_suspend(self) -> None:
        if self._timer is not None:
            self._timer.pause()

    def on_screen_resume(self) -> None:
        self._open_requested_node()
        if self._timeline_ended and isinstance(self.console.client, JournalSource):
            self._follow_timeline()
        if self._timer is not None:
            self._poll() if isinstance(self.console.client, ProvisioningSource) else self._show_nodes()
            self._timer.resume()

    @property
    def pane(self) -> str:
        """The pane shown: `timeline`, `engine` or `provisioning`."""
        return self.query_one("#logs-panes", TabbedContent).active

    def _pane_log(self) -> LogView:
        return self.query_one(_PANE_LOGS.get(self.pane, "#timeline-view"), LogView)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if not self.is_mounted:
            return True
        if action == "host":
            # The host keys are the provisioning pane's: hidden (and inert) on the others.
            return self.pane == "provisioning"
        if action in ("search", "toggle_follow"):
            # In the log itself, its own keys answer (and the key map lists them there).
            focused = self.focused
            return not (focused is not None and self._pane_log() in focused.ancestors_with_self)
        return True

    def action_search(self) -> None:
        """Search the log of the pane shown."""
        self._pane_log().action_search()

    def action_toggle_follow(self) -> None:
        """Pause or resume following the log of the pane shown."""
        self._pane_log().action_toggle_follow()

    def action_pane(self, pane: str) -> None:
        """Show one pane: `timeline`, `engine` or `provisioning`."""
        if pane in _PANES:
            self.query_one("#logs-panes", TabbedContent).active = pane
            # The pane's own keys (the cursor, Enter, `/`) work at once, without tabbing into it, and a key typed
            # right after this one already goes there.
            self._focus_pane(pane)
            self.refresh_bindings()

    def on_log_view_searched(self, message: LogView.Searched) -> None:
        # Each pane's search is remembered between runs, as the fleet's filter is.
        pane = next((pane for pane, selector in _PANE_LOGS.items() if selector == f"#{message.view.id}"), None)
        if pane is not None:
            self.console.preferences.remember_view(f"logs.{pane}", filter=message.text)

    @on(TabbedContent.TabActivated, "#logs-panes")
    def _pane_shown(self) -> None:
        # A click on a tab too: the footer and the key map show the keys of the pane shown.
        self.refresh_bindings()

    def _focus_pane(self, pane: str) -> None:
        selector = {"timeline": "#timeline-view #log-lines", "engine": "#engine-nodes", "provisioning": "#tasks"}
        focus_now(self.query_one(selector[pane]))

    # -- the timeline ------------------------------------------------------------------------------------

    def _follow_timeline(self) -> None:
        client = self.console.client
        assert isinstance(client, JournalSource)
        self._timeline_ended = False
        banner = self.query_one("#timeline-banner", Static)
        banner.display = False
        view = self.query_one("#timeline-view", LogView)
        view.clear()
        view.follow_source(journal_records(client.journal()))

    # -- engine logs -------------------------------------------------------------------------------------

    def _show_nodes(self) -> None:
        table = self.query_one("#engine-nodes", ConsoleTable)
        palette = Palette.from_variables(self.app.theme_variables)
        nodes = sorted(self.console.fleet.nodes.values(), key=lambda node: node.id)
        rows = [(n.id, [n.id, status_text(n.status, palette), n.engine, n.source]) for n in nodes]
        table.show_rows(rows)

    def _open_requested_node(self) -> None:
        node_id = self.console.engine_log_node
        if node_id is not None:
            self.console.engine_log_node = None
            self.call_after_refresh(self.action_pane, "engine")
            self.follow_engine_log(node_id)

    def follow_engine_log(self, node_id: str) -> None:
        """Show `node_id`'s engine log: its last 200 lines, then each new one."""
        client = self.console.client
        if not isinstance(client, JournalSource):
            return
        self.engine_node = node_id
        self.query_one("#engine-title", Static).update(f"Engine log of {node_id}")
        view = self.query_one("#engine-log", LogView)
        view.clear()
        view.follow_source(engine_records(client.engine_log(node_id)))

    # -- provisioning ------------------------------------------------------------------------------------

    def refresh_tasks(self) -> None:
        """Ask for the tasks again now (after an action)."""
        if isinstance(self.console.client, ProvisioningSource):
            self._load()

    @work(exclusive=True, group="provisioning-tasks", exit_on_error=False)
    async def _load(self) -> None:
        client = self.console.client
        assert isinstance(client, ProvisioningSource)
        try:
            tasks = await client.provisioning_tasks()
        except ClientError as exc:
            self.post_message(self.Loaded([], exc.message))
            return
        self.post_message(self.Loaded(tasks, None))

    def on_logs_screen_loaded(self, message: Loaded) -> None:
        banner = self.query_one("#logs-banner", Static)
        if message.error is not None:
            banner.update(f"The provisioning tasks could not be read: {message.error}")
            banner.display = True
            return
        tasks = sorted(message.tasks, key=lambda task: str(task.get("hostname", "")))
        banner.display = not tasks
        banner.update("No host has been set up from this daemon yet: press s to set one up.")
        table = self.query_one("#tasks", ConsoleTable)
        palette = Palette.from_variables(self.app.theme_variables)
        rows = [(str(task.get("hostname", "")), self._cells(task, palette)) for task in tasks]
        table.show_rows(rows)
        if self.host is None and rows:
            self.follow(rows[0][0])

    @staticmethod
    def _cells(task: dict[str, Any], palette: Palette) -> list[str | Text]:
        cells: list[str | Text] = list(task_cells(task))
        state = str(cells[-1])
        cells[-1] = Text(state, style=palette.status(_STATE_STYLES.get(state, "unknown")))
        return cells

    def on_data_table_row_highlighted(self, message: DataTable.RowHighlighted) -> None:
        if message.row_key.value is not None and message.data_table.id == "tasks":
            self.console.selection.host = message.row_key.value

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        if message.row_key.value is None:
            return
        if message.data_table.id == "engine-nodes":
            self.follow_engine_log(message.row_key.value)
        else:
            self.follow(message.row_key.value)

    def follow(self, host: str) -> None:
        """Show `host`'s provisioning log: what the daemon kept, then each new entry."""
        client = self.console.client
        if not isinstance(client, ProvisioningSource):
            return
        self.host = host
        self.console.selection.host = host
        self.query_one("#log-title", Static).update(f"Log of {host}")
        view = self.query_one("#log-view", LogView)
        view.clear()
        view.follow_source(log_records(client.host_log(host)))

    def action_host(self, action: str) -> None:
        """Run a host action on the highlighted host (the provisioning pane's keys)."""
        self.console.host_action(action, self.console.selection.host)

    def on_log_view_source_ended(self, message: LogView.SourceEnded) -> None:
        origin = message.control.id if message.control is not None else None
        if origin == "timeline-view":
            self._timeline_ended = True
            if message.error:
                banner = self.query_one("#timeline-banner", Static)
                banner.update(f"The journal could not be read: {message.error}")
                banner.display = True
        elif origin == "engine-log":
            if message.error:
                self.query_one("#engine-title", Static).update(f"Engine log of {self.engine_node}: {message.error}")
        elif message.error:
            self.notify(f"{self.host}: {message.error}", title="Provisioning log", severity="error")

"""The provisioning screen: every host's last setup or teardown, and the live log of the host picked.

The task table polls `provisioning_tasks()` while the screen is shown; Enter on a host follows its log
(`host_log`) in the log view below, which searches with `/`. The host actions (set up, cancel, tear down, power)
are the app's (`HostActions`): the keys here only name the highlighted host.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Header, Static

from qiip_core.client import ClientError
from qiip_tui._provisioning import TASK_COLUMNS, log_records, task_cells
from qiip_tui._render import Palette
from qiip_tui._types import ProvisioningSource
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import LogView

__all__ = ["NOT_AVAILABLE", "LogsScreen"]

NOT_AVAILABLE = "This daemon does not provision hosts (/admin/provisioning); upgrade it to set hosts up from here."
"""What the screen says when the client cannot ask for provisioning tasks."""

_STATE_STYLES = {"running": "provisioning", "succeeded": "healthy", "failed": "failed", "cancelled": "unknown"}


class LogsScreen(ConsoleScreen[None]):
    """Provisioning tasks, and the log of one host as it happens."""

    AUTO_FOCUS = "#tasks"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("s", "host('setup')", "Set up"),
        Binding("x", "host('cancel')", "Cancel"),
        Binding("t", "host('teardown')", "Tear down"),
        Binding("o", "host('power_on')", "Power on", show=False),
        Binding("k", "host('power_off')", "Power off", show=False),
        Binding("r", "host('power_restart')", "Restart", show=False),
        Binding("q", "app.fleet", "Back"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | enter | Follow the highlighted host's log. |
    | s | Set up a host (a form, then a confirmation). |
    | x | Cancel the highlighted host's running setup or teardown (asks first). |
    | t | Tear the highlighted host's node down (asks first). |
    | o, k, r | Power the highlighted host on, off, or restart it (asks first). |
    | space | Pause or resume following the log. |
    | / | Search the log. |
    | q | Back to the fleet. |
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
        """The host whose log is shown."""
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("Reading the provisioning tasks…", id="logs-banner", markup=False)
        table: DataTable[str | Text] = DataTable(id="tasks", cursor_type="row", zebra_stripes=True)
        yield table
        yield Static("Pick a host and press Enter to follow its log.", id="log-title", markup=False)
        yield LogView(id="log-view")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#tasks", DataTable).add_columns(*TASK_COLUMNS)
        if not isinstance(self.console.client, ProvisioningSource):
            self.query_one("#logs-banner", Static).update(NOT_AVAILABLE)
            return
        self._load()
        self._timer = self.set_interval(self.console.node_poll_s, self._load)

    def on_screen_suspend(self) -> None:
        if self._timer is not None:
            self._timer.pause()

    def on_screen_resume(self) -> None:
        if self._timer is not None:
            self._load()
            self._timer.resume()

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
        table = self.query_one("#tasks", DataTable)
        palette = Palette.from_variables(self.app.theme_variables)
        rows = [(str(task.get("hostname", "")), self._cells(task, palette)) for task in tasks]
        if [key for key, _ in rows] != [row.value for row in table.rows]:
            table.clear()
            for key, cells in rows:
                table.add_row(*cells, key=key)
        else:
            for key, cells in rows:
                for column, cell in zip(table.columns, cells, strict=True):
                    table.update_cell(key, column, cell)
        if self.host is None and rows:
            self.follow(rows[0][0])

    @staticmethod
    def _cells(task: dict[str, Any], palette: Palette) -> list[str | Text]:
        cells: list[str | Text] = list(task_cells(task))
        state = str(cells[-1])
        cells[-1] = Text(state, style=palette.status(_STATE_STYLES.get(state, "unknown")))
        return cells

    def on_data_table_row_highlighted(self, message: DataTable.RowHighlighted) -> None:
        if message.row_key.value is not None:
            self.console.selected_host = message.row_key.value

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        if message.row_key.value is not None:
            self.follow(message.row_key.value)

    def follow(self, host: str) -> None:
        """Show `host`'s log: what the daemon kept, then each new entry."""
        client = self.console.client
        if not isinstance(client, ProvisioningSource):
            return
        self.host = host
        self.console.selected_host = host
        self.query_one("#log-title", Static).update(f"Log of {host}")
        view = self.query_one("#log-view", LogView)
        view.clear()
        view.follow_source(log_records(client.host_log(host)))

    def action_host(self, action: str) -> None:
        """Run a host action on the highlighted host."""
        self.console.host_action(action, self.console.selected_host)

    def on_log_view_source_ended(self, message: LogView.SourceEnded) -> None:
        if message.error:
            self.notify(f"{self.host}: {message.error}", title="Provisioning log", severity="error")

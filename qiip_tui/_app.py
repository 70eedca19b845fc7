"""The operator console: a Textual app that shows and operates a QIIP fleet through its daemon.

```
QiipConsole(config)                        the app; talks to the daemon only (ConsoleClient)
├── modes: fleet (FleetScreen → NodeScreen → SizingScreen), chat, logs, models, connection
├── _follow_events   worker: nodes(), then events(); retries with backoff   → FleetLoaded, NodeChanged, ConnectionLost
├── _poll_metrics    worker, every metrics_interval_s: metrics() + nodes()   → MetricsPolled
├── _poll_lent_hosts worker, with each metrics poll: lent_hosts()            → LentHostsPolled
└── fleet_signal     the fleet's changes, batched, for the screens          (FleetDelta)
```

Workers only await the client and post messages (`qiip_tui._messages`); the handlers here update `fleet` and
the connection state and publish them, so no screen polls and no I/O runs on the UI thread.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.signal import Signal
from textual.theme import Theme

from qiip_core.client import (
    DEFAULT_URL,
    ClientError,
    ConsoleConfig,
    OperationInfo,
    QiipClient,
)
from qiip_tui._app_connection import ConnectionWatch
from qiip_tui._commands import ConsoleCommands
from qiip_tui._connection import RETRY_DELAYS_S, ConnectionProblem
from qiip_tui._fleet import Fleet, FleetDelta
from qiip_tui._messages import FleetLoaded, LentHostsPolled, MetricsPolled, NodeChanged, NodePolled
from qiip_tui._state import ConsoleState, default_state_path, load_state, save_state
from qiip_tui._themes import THEME_DIRS, ThemeFileError, console_variable_defaults, load_themes
from qiip_tui._types import Clock, ConsoleClient, LentHostSource
from qiip_tui.screens import (
    ChatScreen,
    CommandLine,
    ConnectionScreen,
    FleetScreen,
    HelpScreen,
    LogsScreen,
    ModelsScreen,
    NodeScreen,
    SizingScreen,
    key_map,
    run_command,
    screen_name,
)
from qiip_tui.screens._base import ConsoleScreen
from qiip_tui.widgets import FleetTable

__all__ = ["QiipConsole"]


def _freeze_long_lived() -> None:
    # Once the first fleet is shown, the app, its screens and the fleet live as long as the process. Moving them
    # out of the collector's reach keeps full collections short: with a thousand nodes they otherwise scan
    # everything and stall the UI for about 100 ms several times a minute.
    gc.collect()
    gc.freeze()


DEFAULT_THEME = "dark"
"""The theme of a first start, when `themes/dark.toml` is found."""


def _user_theme_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "qiip" / "themes"


class QiipConsole(ConnectionWatch):
    """The operator console.

    Args:
        config: where the daemon is and the credentials (`load_console_config()`).
        url: the daemon's URL, when no `config` is given (no credentials then).
        client: a client to use instead of one built from `config` (the console does not close it).
        state_path: the remembered-preferences file (default `$XDG_CONFIG_HOME/qiip/console-state.json`).
        theme_dirs: where theme files are read, later directories winning (default: the shipped themes,
            then `$XDG_CONFIG_HOME/qiip/themes`).
        clock: a monotonic clock in seconds, for rates and histories.
        wall_clock: the time of day (UTC), for the age of errors and of the data shown (default: now).
        retry_delays_s: seconds between connection attempts, growing; the last one repeats.
        metrics_interval_s: seconds between polls of the metrics and the nodes' live values.
        operation_poll_s: seconds between polls of an operation the console follows.
        node_poll_s: seconds between polls of the node the node screen shows.
        chat_max_tokens: `max_tokens` of chat requests (None: the node's default).
    """

    TITLE = "QIIP"
    CSS_PATH = "console.tcss"
    MODES: ClassVar[dict[str, str | Callable[[], Screen[Any]]]] = {
        "fleet": FleetScreen,
        "chat": ChatScreen,
        "logs": LogsScreen,
        "models": ModelsScreen,
        "connection": ConnectionScreen,
    }
    DEFAULT_MODE = "fleet"
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f", "fleet", "Fleet"),
        Binding("c", "chat", "Chat"),
        Binding("l", "logs", "Logs"),
        Binding("m", "models", "Models"),
        Binding("question_mark", "help", "Keys"),
        Binding("colon", "command_line", "Command"),
    ]
    """
    | Key | Action |
    | :- | :- |
    | f | The fleet. |
    | c | Chat. |
    | l | Logs: the fleet's timeline, engine logs (of the open node, on a node's screen), provisioning. |
    | m | Models: the cache catalog and downloads. |
    | ? | The keys of this screen. |
    | : | The command line (`:drain NODE`, `:node NODE`, `:model M`, …). |
    | ctrl+p | The command palette. |
    """

    def __init__(
        self,
        config: ConsoleConfig | None = None,
        *,
        url: str | None = None,
        client: ConsoleClient | None = None,
        state_path: Path | None = None,
        theme_dirs: Sequence[Path] | None = None,
        clock: Clock = time.monotonic,
        wall_clock: Callable[[], datetime] | None = None,
        retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
        metrics_interval_s: float = 5.0,
        operation_poll_s: float = 0.5,
        node_poll_s: float = 2.0,
        chat_max_tokens: int | None = 512,
    ) -> None:
        super().__init__()
        self.config = config or ConsoleConfig(url=url or DEFAULT_URL)
        """Where the daemon is, and where the credentials came from."""
        self._owns_client = client is None
        self.client: ConsoleClient = client or QiipClient.from_config(self.config)
        self.clock = clock
        self.wall_clock: Callable[[], datetime] = wall_clock or (lambda: datetime.now(UTC))
        """The time of day (UTC) ages are measured against."""
        self.last_update: datetime | None = None
        """When the daemon last told the console something (a snapshot, an event, a poll), UTC."""
        self.retry_delays_s = tuple(retry_delays_s)
        self.metrics_interval_s = metrics_interval_s
        self.operation_poll_s = operation_poll_s
        self.node_poll_s = node_poll_s
        self.chat_max_tokens = chat_max_tokens
        self.fleet = Fleet()
        """Every node the daemon reported, kept current by the workers."""
        self.fleet_signal: Signal[FleetDelta] = Signal(self, "fleet")
        """Published with the nodes that changed, at most once per batch of messages."""
        self.connection_signal: Signal[None] = Signal(self, "connection")
        """Published when the connection's state changes."""
        self.operation_signal: Signal[OperationInfo] = Signal(self, "operation")
        """Published when an operation the console follows changes."""
        self.operations: dict[str, OperationInfo] = {}
        """Operations started from this console, by id."""
        self.selected_node: str | None = None
        """The node the palette's node commands act on: highlighted in the fleet table or open."""
        self.selected_host: str | None = None
        """The host the palette's host commands act on: highlighted in the provisioning table."""
        self.engine_log_node: str | None = None
        """A node whose engine log the logs screen opens next (`l` on a node's screen)."""
        self.connected = False
        """Whether the daemon answered the last attempt."""
        self.connection_problem: ConnectionProblem | None = None
        """Why the last attempt failed."""
        self.connection_attempt: tuple[int, float | None] = (0, 0.0)
        """Failed attempts in a row, and seconds until the next (None: the console waits for the operator)."""
        self._mode_before_problem = "fleet"
        self._reads_quads: bool | None = None  # None: not asked since connecting
        self._pending = FleetDelta()
        self._flush_scheduled = False
        self._frozen = False
        self.state_path = state_path or default_state_path()
        self._state = load_state(self.state_path)
        dirs = list(theme_dirs) if theme_dirs is not None else [*THEME_DIRS, _user_theme_dir()]
        themes, self.theme_errors = load_themes(dirs)
        self.console_themes: dict[str, Theme] = {theme.name: theme for theme in themes}
        """The themes read from files, by name."""
        for theme in themes:
            self.register_theme(theme)

    # -- start and stop ----------------------------------------------------------------------------------

    def get_theme_variable_defaults(self) -> dict[str, str]:
        # Textual's own themes do not know the console's variables: derive them from the theme's colours.
        return console_variable_defaults(self.current_theme.to_color_system().generate())

    def on_mount(self) -> None:
        self.sub_title = self.client.url
        wanted = self._state.theme
        for name in (wanted, DEFAULT_THEME):
            if name and name in self.available_themes:
                self.theme = name
                break
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        if len(self.theme_errors) > 2:
            # One notification rather than a stack of them over the table.
            names = ", ".join(error.path.name for error in self.theme_errors)
            first = self.theme_errors[0].message
            message = f"{len(self.theme_errors)} theme files skipped: {names}. The first: {first}"
            self.notify(message, title="Theme files skipped", severity="warning", timeout=15)
        else:
            for error in self.theme_errors:
                self.notify(error.message, title="Theme file skipped", severity="warning", timeout=10)
        self._follow_events()
        self.set_interval(self.metrics_interval_s, self._poll_metrics)

    async def on_unmount(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    def set_theme(self, name: str) -> None:
        """Switch to the theme `name` (remembered for the next start).

        Raises:
            ThemeFileError: no theme has that name.
        """
        if name not in self.available_themes:
            raise ThemeFileError(f"There is no theme named {name!r}.", path=self.state_path)
        self.theme = name

    def _remember_theme(self, theme: Theme) -> None:
        if theme.name != self._state.theme:
            self._state = ConsoleState(theme=theme.name)
            self._save_state(self._state)

    @work(thread=True, exclusive=True, group="state", exit_on_error=False)
    def _save_state(self, state: ConsoleState) -> None:
        try:
            save_state(self.state_path, state)
        except OSError as exc:
            self.call_from_thread(self.notify, f"Cannot remember the theme in {self.state_path}: {exc}.")

    # -- the connection ----------------------------------------------------------------------------------
    def on_fleet_loaded(self, message: FleetLoaded) -> None:
        self.last_update = self.wall_clock()
        self._publish(self.fleet.load(message.nodes))
        if not self._frozen:
            # After the screens have built their rows from this first fleet.
            self._frozen = True
            self.set_timer(1.0, _freeze_long_lived)
        if not self.connected:
            self.connected, self.connection_problem, self.connection_attempt = True, None, (0, 0.0)
            self._reads_quads = None  # the daemon may have restarted with other settings
            self.connection_signal.publish(None)
            if self.current_mode == "connection":
                self.switch_mode(self._mode_before_problem)
            # Rates and TTFT at once, rather than one interval after connecting.
            self._poll_metrics()

    def on_node_changed(self, message: NodeChanged) -> None:
        self.last_update = self.wall_clock()
        self._publish(self.fleet.apply(message.event))

    @work(exclusive=True, group="metrics", exit_on_error=False)
    async def _poll_metrics(self) -> None:
        if not self.connected:
            return
        try:
            payload = await self.client.metrics()
            nodes = await self.client.nodes()
        except ClientError:
            # The event stream may be stuck on a dead connection: start over, which reports the outage.
            self._follow_events()
            return
        self.post_message(MetricsPolled(payload, nodes, at_s=self.clock()))
        if self._reads_quads is not False and isinstance(self.client, LentHostSource):
            self._poll_lent_hosts(self.client)

    @work(exclusive=True, group="quads", exit_on_error=False)
    async def _poll_lent_hosts(self, client: LentHostSource) -> None:
        # Its own worker: a slow answer must not hold up (or, overlapping the next, cancel) the metrics poll.
        try:
            lent = await client.lent_hosts()
        except ClientError:
            return  # the metrics poll reports an outage
        self.post_message(LentHostsPolled(lent))

    def on_lent_hosts_polled(self, message: LentHostsPolled) -> None:
        # A daemon without [quads] is not asked again until the console reconnects.
        self._reads_quads = message.lent.freshness is not None
        self.fleet.lent = message.lent if self._reads_quads else None
        self.fleet_signal.publish(FleetDelta())

    def on_metrics_polled(self, message: MetricsPolled) -> None:
        self.last_update = self.wall_clock()
        changed = set(self.fleet.apply_metrics(message.payload, at_s=message.at_s).changed)
        update = self.fleet.update
        for node in message.nodes:
            changed.update(update(node).changed)
        if changed:
            self._publish(FleetDelta(changed=frozenset(changed)))
        # An empty change says a poll happened: the summary's rate and the errors' ages move on.
        self.fleet_signal.publish(FleetDelta())

    def on_node_polled(self, message: NodePolled) -> None:
        if message.node.id in self.fleet.nodes:
            self._publish(self.fleet.update(message.node))

    def _publish(self, delta: FleetDelta) -> None:
        """Queue a change; the screens hear of all changes queued by the same batch of messages at once."""
        self._pending = self._pending.merge(delta)
        if delta and not self._flush_scheduled:
            self._flush_scheduled = True
            self.call_later(self._flush_fleet)

    def _flush_fleet(self) -> None:
        self._flush_scheduled = False
        delta, self._pending = self._pending, FleetDelta()
        if delta:
            self.fleet_signal.publish(delta)

    # -- navigation --------------------------------------------------------------------------------------

    def on_fleet_table_node_highlighted(self, message: FleetTable.NodeHighlighted) -> None:
        self.selected_node = message.node_id

    def action_fleet(self) -> None:
        """Show the fleet (from the node screen too)."""
        if self.current_mode == "fleet":
            while len(self.screen_stack) > 1:
                self.pop_screen()
        else:
            self.switch_mode("fleet")

    def action_chat(self) -> None:
        """Show the chat."""
        self.switch_mode("chat")

    def action_logs(self) -> None:
        """Show the logs screen: the fleet's timeline, engine logs and provisioning; from a node's screen, that
        node's engine log."""
        if isinstance(self.screen, NodeScreen):
            self.engine_log_node = self.screen.node_id
        self.switch_mode("logs")  # the screen opens the requested node when it mounts or resumes

    def action_models(self) -> None:
        """Show the models: the cache catalog and downloads."""
        self.switch_mode("models")

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        # Textual's "Keys" (its help panel) would sit beside the console's own key map under the same name.
        return (command for command in super().get_system_commands(screen) if command.title != "Keys")

    def action_help(self) -> None:
        """Show the keys of the current screen."""
        if isinstance(self.screen, HelpScreen):
            return
        rows = key_map(
            self.screen.active_bindings.values(),
            key_display={b.binding.key: self.get_key_display(b.binding) for b in self.screen.active_bindings.values()},
        )
        self.push_screen(HelpScreen(rows, title=screen_name(self.screen)))

    def action_command_line(self) -> None:
        """Open the `:` command line over a main screen (not over the sizing editor, a dialog or the key map)."""
        if isinstance(self.screen, ConsoleScreen) and not isinstance(self.screen, SizingScreen):
            self.push_screen(CommandLine(self.fleet), partial(run_command, self))
